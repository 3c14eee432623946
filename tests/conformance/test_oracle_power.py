"""The oracle's power at 3-4 ranks, on real gloo worlds through the case pipeline
(tests/conformance/power_engines.py): the summation-order envelope catches one ulp in one
fp32 gradient element, and under autocast bf16 at 4 ranks a bf16 reduction and a gradient
scaled by 0.99, each at the step where it happens; the same hook without the defect passes."""

import pytest

from conformance.adapters.registry import ddp_class_spec
from conformance.judge.compare import ConformanceError
from conformance.pipeline import check
from tests.conformance.area_cases import scenario

pytestmark = pytest.mark.slow  # w3/w4 gloo worlds

FP32 = ["ddp/plain/mlp/w3/fp32", "ddp/plain/mlp/w4/fp32"]
AUTOCAST_W4 = "ddp/autocast-bf16-scaler/mlp/w4/fp32"
AUTOCAST_W3 = "ddp/autocast-bf16/transformer/w3/fp32"  # continuous data: orders really differ


def _spec(name: str) -> str:
    return ddp_class_spec(f"tests.conformance.power_engines:{name}")


@pytest.mark.parametrize("scenario_id", [*FP32, AUTOCAST_W4, AUTOCAST_W3])
def test_the_defect_free_hook_passes(scenario_id, session):
    checked = check(scenario(scenario_id), _spec("PlainHook"), session)
    assert checked.details["oracle"]["kind"] == "summation-order"
    assert checked.details["oracle"]["straight_through"].startswith("within")


@pytest.mark.parametrize("scenario_id", FP32)
def test_one_ulp_in_one_fp32_gradient_element_is_caught(scenario_id, session):
    with pytest.raises(ConformanceError) as info:
        check(scenario(scenario_id), _spec("OneUlp"), session)
    message = str(info.value)
    assert "after backward (step 0" in message and "1 of" in message and "outside the envelope" in message
    assert "(1 ulps)" in message  # how far outside the rule the value lies


@pytest.mark.parametrize("engine", ["Bf16Reduce", "Scaled099"])
def test_autocast_bf16_at_four_ranks_catches_a_bf16_reduction_and_a_scaled_gradient(engine, session):
    with pytest.raises(ConformanceError) as info:
        check(scenario(AUTOCAST_W4), _spec(engine), session)
    message = str(info.value)
    # Dyadic data, so every summation order agrees here: the envelope collapses to one value.
    assert "after backward (step 0" in message and "elements differ (bitwise to a summation order" in message
    assert "outside the rule" in message


@pytest.mark.parametrize("engine", ["Bf16Reduce", "Scaled099"])
def test_autocast_bf16_on_continuous_data_catches_them_outside_a_real_envelope(engine, session):
    with pytest.raises(ConformanceError) as info:
        check(scenario(AUTOCAST_W3), _spec(engine), session)
    message = str(info.value)
    assert "after backward (step 0" in message and "outside the envelope (summation-order" in message
