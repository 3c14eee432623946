"""The area registry (conformance/area.py): one definition per area, from which everything
else takes the area names, and one judging signature for every area."""

import inspect

import pytest

from conformance import area, catalogue, mutants
from conformance.frontends import options
from conformance.harness.context import resolve
from conformance.spec import Scenario


def test_every_area_is_defined_once_and_everything_derives_from_it():
    assert tuple(area.AREAS) == area.NAMES == options.AREA_CHOICES
    assert {s.area for s in catalogue.all_scenarios()} == set(area.NAMES)
    assert set(mutants.ZOO_AREAS) <= set(area.NAMES)
    with pytest.raises(ValueError, match="unknown area 'nope'"):
        Scenario(id="nope/x", area="nope", model="mlp")
    with pytest.raises(ValueError, match="unknown area 'nope'; one of ddp"):
        area.get("nope")


@pytest.mark.parametrize("name", area.NAMES)
def test_one_judge_signature_and_functions_not_strings(name):
    a = area.AREAS[name]
    assert list(inspect.signature(a.judge).parameters)[:3] == ["scenario", "adapter_spec", "records"]
    assert all(callable(f) for f in (a.scenarios, a.task, a.judge, a.oracle))
    assert resolve(a.task_ref) is a.task  # what rank processes import is the area's own task


def test_topology_follows_the_area():
    dist_autograd = next(s for s in catalogue.all_scenarios() if s.area == "dist_autograd")
    assert area.AREAS["dist_autograd"].topology(dist_autograd.with_(device="cuda")).device == "cpu"  # RPC stays on CPU
    ddp = next(s for s in catalogue.all_scenarios() if s.area == "ddp" and s.world_size == 2)
    assert area.AREAS["ddp"].topology(ddp).key() == "w2/gloo/cpu"
