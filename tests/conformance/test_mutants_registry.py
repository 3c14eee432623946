"""conformance/mutants/registry.py: one table per area zoo; the decorator names the bug and the
clause, and each mutant loads by its adapter spec like a third-party adapter."""

from __future__ import annotations

import pytest

from conformance.adapters import registry as adapters
from conformance.mutants import ZOO_AREAS, area_zoo
from conformance.mutants.registry import Registry


def test_the_decorator_names_the_mutant_and_factories_build_fresh_instances():
    table = Registry("zoo-x")

    class Correct:
        pass

    @table.mutant("drops-last", "X3", "the last chunk is dropped", may_abort=True)
    class DropsLast(Correct):
        pass

    assert table == {"drops-last": DropsLast}
    assert (DropsLast.name, DropsLast.clause, DropsLast.bug, DropsLast.may_abort) == (
        "zoo-x-drops-last", "X3", "the last chunk is dropped", True)
    factory = table.factories()["drops_last"]
    one, two = factory(), factory()
    assert isinstance(one, DropsLast) and one is not two


def test_an_adapter_builder_wraps_what_is_not_an_adapter_itself():
    table = Registry("zoo-y")

    def make_adapter(delegate):
        return type("Adapter", (), {"delegate": delegate})

    @table.mutant("late", "Y1", "flushes late", adapter=make_adapter)
    def late_delegate():
        return "late"

    assert late_delegate() == "late"  # the decorated object is returned unchanged
    assert table["late"].delegate is late_delegate and table["late"].name == "zoo-y-late"


@pytest.mark.parametrize("area", [a for a in ZOO_AREAS if a != "ddp"])
def test_every_area_mutant_loads_by_its_spec_with_its_bug_and_clause(area):
    zoo = area_zoo(area)
    assert zoo.mutants and zoo.base in zoo.controls
    for name, mutant in zoo.mutants.items():
        adapter = adapters.load(mutant.spec)
        assert adapter.area == area, (name, adapter.area)
        assert mutant.bug and mutant.clause, name
    assert adapters.load(zoo.base).area == area


def test_the_interactions_zoo_loads_outside_all_with_each_pair_named():
    """Issue 38: at least 15 interaction mutants (every area), each naming the two things that meet, loadable
    by spec, judged against a correct base that is a control; not in `--set all`."""
    total = 0
    for area in ("ddp", "sharded", "bucketer", "data_parallel", "dist_autograd"):
        zoo = area_zoo(area, "interactions")
        assert set(zoo.controls) >= {m.base for m in zoo.mutants.values()} | {zoo.base}
        for name, mutant in zoo.mutants.items():
            assert name.startswith("ix-") and name not in area_zoo(area, "all").mutants
            assert adapters.load(mutant.spec).area == area
            assert mutant.clause and mutant.bug.startswith("[") and " x " in mutant.bug.split("]")[0], name
        total += len(zoo.mutants)
    assert total >= 15
    with pytest.raises(ValueError, match="no interactions zoo"):
        area_zoo("no-such-area", "interactions")
