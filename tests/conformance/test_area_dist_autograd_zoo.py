"""The dist_autograd area's zoo: one known-bad implementation per clause of
docs/contracts/dist_autograd.md, each caught where its bug fired (counts summed over every
worker); the correct base passes through the same path; the judge fails on one element
outside the tolerance, on a missing gradient and on a zero where none is expected."""

import pytest
import torch

from conformance import catalogue
from conformance.judge.compare import ConformanceError
from conformance.mutants import dist_autograd as zoo
from conformance.oracle import dist_autograd as dist_autograd_oracle
from conformance.pipeline import check
from conformance.runners import dist_autograd as driver
from tests.conformance.area_cases import assert_caught, mutant_spec, recording
from tests.conformance.area_cases import scenario as _get

PREFIX = "conformance.mutants.dist_autograd:"



def test_every_clause_has_a_mutant_and_a_scenario():
    clauses = {c for s in catalogue.select(area="dist_autograd", profile="standard") for c in s.clauses}
    assert {cls.clause for cls in zoo.MUTANTS.values()} == clauses == {f"A{i}" for i in range(1, 19)}


@pytest.mark.slow
def test_the_zoo_base_passes_through_the_same_path(session):
    # first: a mutant's case may leave work behind on a worker (cleanup is asynchronous)
    for scenario_id in sorted({s for s, _ in CAUGHT.values()}):
        assert check(_get(scenario_id), PREFIX + "correct", session).comparisons >= 3


# a cheap subset on quick-profile scenarios; `gradparity zoo --area dist_autograd` runs them all
CAUGHT = {
    "same-tensor-once": ("dist_autograd/fan-out/w3/fp64", "differ"),
    "remote-gradients-missing": ("dist_autograd/chain/w3/fp64", "differ"),
    "context-ids-per-worker": ("dist_autograd/contexts-meet/w3/fp64", "got the same id"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_broken_implementations_are_caught_where_they_fire(session, name):
    scenario_id, needle = CAUGHT[name]
    session.last_outcome = None
    with recording(session) as outcomes:
        assert_caught(lambda s, spec: check(s, spec, session), scenario_id, mutant_spec("dist_autograd", name), needle)
    assert outcomes[-1].values[0]["mutation_fired"] > 0, f"{name} failed without its bug firing"


# -- meta: the judge on hand-built records -----------------------------------------------------
def _records():
    scenario = _get("dist_autograd/simple/w2/fp64")
    expected = dist_autograd_oracle.oracle(scenario, "simple")
    rec = {"passes": [{n: g.clone() for n, g in expected.items()}], "dot_grad": [], "cleanup": {"clean": True}}
    return scenario, expected, rec


def test_judge_passes_the_oracle_itself():
    scenario, expected, rec = _records()
    assert driver._compare_passes(scenario, "meta", "simple", rec, expected, "repro") == 3


@pytest.mark.parametrize("change, needle", [
    ("outside-tolerance", "differ"), ("missing", "differ"), ("zeros-where-none", "differ"),
    ("dot-grad", "wrote .grad"), ("leak", "still hold contexts"),
])
def test_judge_fails_on_one_difference(change, needle):
    scenario, expected, rec = _records()
    grads = rec["passes"][0]
    if change == "outside-tolerance":  # one element, 1e-9 off: far outside the float64 band
        grads["x@worker0"].view(-1)[3] += 1e-9
    elif change == "missing":
        del grads["w@worker0"]
    elif change == "zeros-where-none":
        grads["u@worker0"] = torch.zeros(4, 4, dtype=torch.float64)
        expected = dict(expected, **{"u@worker0": None})
    elif change == "dot-grad":
        rec["dot_grad"] = ["x"]
    else:
        rec["cleanup"] = {"clean": False, "left": {1: {"num_autograd_contexts": 1}}}
    with pytest.raises(ConformanceError, match=needle):
        driver._compare_passes(scenario, "meta", "simple", rec, expected, "repro")
