"""conformance/mutants/moe.py: each MoE bug is caught by the MoE scenario, in the tensors it
breaks, and only where it fired; the correct base and torch DDP pass the same scenario."""

from __future__ import annotations

import pytest

from conformance import mutants
from conformance.adapters.registry import ddp_class_spec
from conformance.pipeline import Case, run_case
from tests.conformance.area_cases import scenario

MOE_W2 = "ddp/plain/moe/w2/fp32"
# mutant -> a tensor its bug must show in (the first failing step's message names it)
BROKEN = {
    "expert-wrong-group": "experts.",
    "unused-expert-left-out": "experts.",
    "aux-loss-scaled-twice": "router.weight",
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_moe_mutant_is_caught_where_it_fired(session, name):
    path, bug = mutants.MUTANTS[name]
    result = run_case(Case(scenario(MOE_W2), ddp_class_spec(path)), session)
    assert result.verdict == "failed" and result.fired, (result.verdict, result.fired, result.message)
    assert "step 0" in result.message and BROKEN[name] in result.message, result.message


@pytest.mark.parametrize("spec", ["torch-ddp", ddp_class_spec(mutants.BASE)])
def test_the_correct_engines_pass_the_moe_scenario(session, spec):
    result = run_case(Case(scenario(MOE_W2), spec), session)
    assert result.verdict == "passed", result.message


def test_the_unused_expert_mutant_is_quiet_where_no_expert_is_idle(session):
    """A dense model leaves no parameter idle on one rank: the mutation never fires, nothing fails."""
    path, _ = mutants.MUTANTS["unused-expert-left-out"]
    result = run_case(Case(scenario("ddp/plain/gpt/w2/fp32"), ddp_class_spec(path)), session)
    assert result.verdict == "passed" and not result.fired, result.message
