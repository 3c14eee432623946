"""The zero-adapter route (`--ddp-class`) never fails a correct average (#40): undeclared, a class
is judged against every exact placement of 1/W and the report says which one it matched; a class
pins one with `gradparity_semantics`, and a failure that matches another placement says so in its
first line; a real scaling error (1 + 2**-19 at 3 ranks) still fails. A real w3 gloo world."""

import pytest

from conformance.adapters import registry
from conformance.adapters.ddp_like import class_semantics
from conformance.adapters.registry import ddp_class_spec
from conformance.case import Case
from conformance.pipeline import run_case
from conformance.semantics import Scaling
from tests.conformance.area_cases import scenario

SCENARIO = "ddp/plain/mlp/w3/fp32"  # 3 ranks: fl(1/3) makes "pre" and "post" differ in the last bit


def _run(cls: str, session):
    return run_case(Case(scenario(SCENARIO), ddp_class_spec(f"tests.conformance.placement_engines:{cls}")), session)


def test_a_declaration_is_read_and_a_bad_one_is_one_line():
    assert class_semantics(type("Undeclared", (), {})).scaling is Scaling.EITHER
    assert class_semantics(type("Pinned", (), {"gradparity_semantics": "post"})).scaling is Scaling.POST
    bad = type("Bad", (), {"gradparity_semantics": "sideways"})
    with pytest.raises(ValueError, match="declare a conformance.semantics.Semantics, or where 1/W is applied"):
        class_semantics(bad)
    spec = ddp_class_spec("tests.conformance.placement_engines:SumThenScale")
    assert registry.load(spec).semantics.scaling is Scaling.EITHER
    assert "either exact placement of 1/W accepted" in registry.load(spec).semantics.describe()


@pytest.mark.slow
def test_a_sum_then_scale_engine_passes_undeclared_and_the_report_says_post(session):
    result = _run("SumThenScale", session)
    assert result.verdict == "passed", result.message
    assert result.checked.details["oracle"]["placement_matched"] == "post"


@pytest.mark.slow
def test_torch_ddp_through_the_zero_adapter_route_matches_pre(session):
    result = run_case(Case(scenario(SCENARIO), ddp_class_spec("torch.nn.parallel:DistributedDataParallel")), session)
    assert result.verdict == "passed", result.message
    assert result.checked.details["oracle"]["placement_matched"] == "pre"


@pytest.mark.slow
def test_a_pinned_placement_is_checked_and_a_wrong_one_named_in_the_first_line(session):
    assert _run("DeclaredPost", session).verdict == "passed"
    result = _run("DeclaredPre", session)
    assert result.verdict == "failed"
    first = result.message.splitlines()[0]
    assert "they match 1/W placed post, not the declared pre" in first, first


@pytest.mark.slow
def test_a_real_scaling_error_still_fails(session):
    result = _run("SlightlyScaled", session)
    assert result.verdict == "failed" and result.failure.failure_class.value == "wrong value"
    assert "gradients differ from the oracle" in result.message and "they match 1/W placed" not in result.message
