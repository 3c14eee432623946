"""Each dist_autograd interaction mutant (issue 38) is caught on a generated row where its two things
meet, with its bug fired there (counts summed over every worker); the correct base passes those
rows through the same path. The rows are built from their values (`dist_autograd_rows.scenario`),
so the test does not depend on which rows the stored arrays hold."""

from __future__ import annotations

import pytest

from conformance.judge.compare import ConformanceError
from conformance.mutants.independent import interactions_dist_autograd as zoo
from conformance.pipeline import check
from conformance.space.dist_autograd_rows import DEFAULTS, scenario
from tests.conformance.area_cases import recording

pytestmark = pytest.mark.slow
PREFIX = "conformance.mutants.independent.interactions_dist_autograd:"

# mutant -> (the row's values where its pair meets, what the failure says)
WHERE = {
    "async-nested-args-detached": ({"call": "async", "structure": "nested"}, "differ"),
    "hop-rref-detached": ({"topology": "chain", "world": 3, "call": "rref"}, "differ"),
    "callee-buffers-outlive-context": ({"params": "remote", "contexts": "two"}, "differ"),
    "async-path-error-swallowed": ({"call": "async", "error": "remote"}, "should have raised"),
    "nested-unused-zero-filled": ({"unused": "arg", "structure": "nested"}, "differ"),
    "fp32-sums-kept-fp64": ({"topology": "sent-twice", "dtype": "fp32"}, "dtype torch.float64 but expected"),
    "roots-local-part-dropped": ({"roots": "several"}, "differ"),
}


def _row_scenario(values: dict):
    return scenario(dict(DEFAULTS, **values), frozenset({"standard"}))


def _checked(session, s, spec):
    """`check` that also returns the workers' records (the mutation counts are in worker 0's)."""
    with recording(session) as outcomes:
        try:
            return check(s, spec, session), outcomes
        except ConformanceError as exc:
            return exc, outcomes


def test_every_mutant_has_a_row_where_its_pair_meets():
    assert set(WHERE) == set(zoo.MUTANTS)


def test_the_correct_base_passes_every_row(session):
    for name, (values, _) in sorted(WHERE.items()):
        result, _ = _checked(session, _row_scenario(values), PREFIX + "correct")
        assert not isinstance(result, ConformanceError), f"{name}'s row: {result}"


@pytest.mark.parametrize("name", sorted(WHERE))
def test_each_mutant_is_caught_where_its_two_things_meet(session, name):
    values, needle = WHERE[name]
    s = _row_scenario(values)
    result, outcomes = _checked(session, s, PREFIX + name.replace("-", "_"))
    assert isinstance(result, ConformanceError), f"{name} passed {s.id}"
    assert s.id in str(result) and needle in str(result), str(result)
    assert outcomes[-1].values[0]["mutation_fired"] > 0, f"{name} failed without its bug firing"
