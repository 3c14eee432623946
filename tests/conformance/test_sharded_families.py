"""Issue 26 part B: the sharded families (conformance/catalogue/sharded_families.py) and their
mutants (conformance/mutants/sharded_families.py): each clause has standard scenarios, each
mutant is caught on its clause's scenario with its bug firing, and its control passes there."""

import pytest

from conformance import catalogue
from conformance.case import Case
from conformance.catalogue import sharded_families
from conformance.pipeline import run_case
from conformance.spec import Capability as C
from tests.conformance.area_cases import mutant_spec
from tests.conformance.area_cases import scenario as _get


def test_each_family_is_in_the_standard_profile_with_its_clause_and_capability():
    ids = [s.id for s in sharded_families.scenarios()]
    assert len(ids) == len(set(ids))
    standard = {s.id: s for s in catalogue.select(area="sharded", profile="standard")}
    mine = [standard[i] for i in ids if i in standard]
    assert {c for s in mine for c in s.clauses} >= {"S15", "S16", "S17", "S18"}
    need = {"S16": C.STATE_DICT, "S17": C.CPU_OFFLOAD, "S18": C.SHARD_PLACEMENT}
    for s in mine:
        for clause, capability in need.items():
            assert (clause in s.clauses) == (capability in s.requires), s.id
    assert all(dict(s.model_kwargs).get("two_forwards") for s in mine if "S15" in s.clauses)


# mutant -> (a scenario of its clause, what the failure says)
CAUGHT = {
    "regather-hook-once": ("sharded/nested-two-forwards/mlp/w2/fp32", "out of bounds for storage of size 0"),
    "dcp-load-skips-optimizer": ("sharded/state-dict-sharded/mlp/w2/fp32", "step 2"),
    "offload-optimizer-before-shard": ("sharded/cpu-offload/mlp/w2/fp32", "step 0"),
    "placement-fn-ignored": ("sharded/shard-placement/mlp/w2/fp32", "ignored the placement function"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_each_mutant_is_caught_on_its_clause_and_its_control_passes(session, name):
    from conformance.mutants import sharded as zoo

    scenario_id, needle = CAUGHT[name]
    result = run_case(Case(_get(scenario_id), mutant_spec("sharded", name)), session)
    assert result.verdict == "failed", result.message
    assert scenario_id in result.message and needle in result.message, result.message
    if not zoo.MUTANTS[name].may_abort:  # one that makes torch raise sends back no record to count in
        stats = result.details.get("backward_stats") or {}
        assert sum(s["mutation_fired"] for s in stats.values()) > 0, f"{name} failed without its bug firing"
    control = zoo.MUTANTS[name].base
    passed = run_case(Case(_get(scenario_id), control), session)
    assert passed.verdict == "passed" and passed.checked.comparisons > 5, passed.message
