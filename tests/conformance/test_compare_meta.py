"""Meta-tests of the comparison helpers: a checker that lets these through is blind.

No processes: a hand-built oracle (`Baseline`) and hand-built rank records go through the
same `contract.check_records` the suite uses. Each test starts from records that pass and
breaks exactly one thing: a 1-ulp difference in an exact scenario, a wrong dtype, a missing
gradient, a gradient where `None` is expected.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conformance.judge.compare import ConformanceError, compare_tensor
from conformance.judge.contract import check_records
from conformance.oracle.baseline import Baseline, Expected
from conformance.spec import EXACT, Scenario

W = 2
SCENARIO = Scenario(id="ddp/meta/hand-built/w2/fp32", area="ddp", model="mlp", world_size=W, steps=1, tolerance=EXACT)
ADAPTER = "meta-adapter"


def _oracle():
    params = {"w": torch.tensor([[1.0, -2.0], [0.5, 3.0]]), "b": torch.tensor([0.25, -1.0]), "unused": torch.zeros(2)}
    grads = {"w": torch.tensor([[0.5, 1.5], [-2.0, 4.0]]), "b": torch.tensor([1.0, -0.75]), "unused": None}
    stepped = {n: p - 0.0625 * grads[n] if grads[n] is not None else p.clone() for n, p in params.items()}
    buffers = {"running": torch.tensor([1.0, 2.0])}
    events = [Expected("backward", 0, 0, True, [grads] * W), Expected("step", 0, 0, True, [stepped] * W, buffers=[buffers] * W)]
    baseline = Baseline(SCENARIO, params, buffers, events)
    records = {
        r: {
            "init": {"parameters": params, "buffers": buffers},
            "events": [
                {"kind": "backward", "step": 0, "micro": 0, "synced": True, "values": grads},
                {"kind": "step", "step": 0, "values": stepped, "buffers": buffers},
            ],
            "error": None,
        }
        for r in range(W)
    }
    return baseline, copy.deepcopy(records)


def _ulp_up(t: torch.Tensor, index=(0,)) -> torch.Tensor:
    t = t.clone()
    t[index] = torch.nextafter(t[index], torch.tensor(float("inf"), dtype=t.dtype))
    return t


def _check(records):
    baseline, _ = _oracle()
    return check_records(SCENARIO, ADAPTER, baseline, records)


def test_untouched_records_pass():
    _, records = _oracle()
    checked = _check(records)
    assert checked.comparisons > 0 and checked.accepted_error is None


@pytest.mark.parametrize("ranks", [(1,), (0, 1)], ids=["one-rank", "every-rank"])
def test_one_ulp_in_a_gradient_fails(ranks):
    _, records = _oracle()
    for r in ranks:
        grads = dict(records[r]["events"][0]["values"])
        grads["w"] = _ulp_up(grads["w"], (1, 0))
        records[r]["events"][0]["values"] = grads
    with pytest.raises(ConformanceError) as info:
        _check(records)
    message = str(info.value)
    assert f"rank {ranks[0]}" in message and "w:" in message and "bitwise" in message
    assert "[1, 0]" in message and "expected -2.0" in message  # the worst index, expected value


def test_one_ulp_in_a_stepped_parameter_fails():
    _, records = _oracle()
    for r in range(W):
        values = dict(records[r]["events"][1]["values"])
        values["b"] = _ulp_up(values["b"], (1,))
        records[r]["events"][1]["values"] = values
    with pytest.raises(ConformanceError, match=r"after optimizer step 0: parameters differ"):
        _check(records)


def test_one_ulp_in_the_initial_state_fails():
    _, records = _oracle()
    params = dict(records[1]["init"]["parameters"])
    params["w"] = _ulp_up(params["w"])
    records[1]["init"]["parameters"] = params
    with pytest.raises(ConformanceError, match=r"after construction.*construction-time broadcast"):
        _check(records)


def test_wrong_dtype_fails_even_with_equal_values():
    _, records = _oracle()
    for r in range(W):
        grads = dict(records[r]["events"][0]["values"])
        grads["b"] = grads["b"].double()  # the same numbers, the wrong dtype
        records[r]["events"][0]["values"] = grads
    with pytest.raises(ConformanceError, match=r"b: dtype torch.float64 but expected torch.float32"):
        _check(records)


def test_missing_gradient_fails():
    _, records = _oracle()
    for r in range(W):
        grads = dict(records[r]["events"][0]["values"])
        grads["w"] = None
        records[r]["events"][0]["values"] = grads
    with pytest.raises(ConformanceError, match=r"w: expected a gradient but got None"):
        _check(records)


@pytest.mark.parametrize("value", [torch.zeros(2), torch.tensor([0.0, 1.0])], ids=["zero-filled", "non-zero"])
def test_gradient_where_none_expected_fails(value):
    _, records = _oracle()
    for r in range(W):
        grads = dict(records[r]["events"][0]["values"])
        grads["unused"] = value
        records[r]["events"][0]["values"] = grads
    with pytest.raises(ConformanceError, match=r"unused: expected grad None"):
        _check(records)


def test_a_missing_rank_fails():
    _, records = _oracle()
    del records[1]
    with pytest.raises(ConformanceError, match=r"no result from rank\(s\) \[1\]"):
        _check(records)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_compare_tensor_one_ulp_every_dtype(dtype):
    a = torch.tensor([1.0, -3.0, 0.5], dtype=dtype)
    assert compare_tensor("p", a, a.clone(), EXACT) is None
    mismatch = compare_tensor("p", a, _ulp_up(a, (1,)), EXACT)
    assert mismatch is not None and mismatch.worst_index == (1,) and mismatch.expected_value == -3.0


def test_compare_tensor_none_and_dtype():
    a = torch.ones(3)
    assert "got None" in compare_tensor("p", a, None, EXACT).problem
    assert "expected grad None" in compare_tensor("p", None, torch.zeros(3), EXACT).problem
    assert "dtype" in compare_tensor("p", a, a.to(torch.float16), EXACT).problem
    assert compare_tensor("p", None, None, EXACT) is None


def test_a_rank_that_raised_before_its_record_is_class_raised_not_a_wrong_value():
    """Found by the Lightning Fabric newcomer run: a rank whose engine raised in backward was
    reported as a `wrong value` ("stopped before after backward"); it is a raise, and says so."""
    from conformance.judge.failure import FailureClass, classify_exception

    _, records = _oracle()
    for r in range(W):
        records[r]["events"] = []
        records[r]["error"] = {"type": "AssertionError", "message": "First bucket should be smaller\nmore", "step": 0}
    with pytest.raises(ConformanceError) as info:
        _check(records)
    classified = classify_exception(info.value)
    assert classified.failure_class is FailureClass.RAISED
    assert classified.cause == "rank 0 raised AssertionError: First bucket should be smaller"
    assert "produced no record for after backward (step 0" in str(info.value)


def test_a_rank_that_stops_short_without_an_error_stays_a_wrong_value():
    from conformance.judge.failure import FailureClass, classify_exception

    _, records = _oracle()
    records[1]["events"] = records[1]["events"][:1]
    with pytest.raises(ConformanceError) as info:
        _check(records)
    assert classify_exception(info.value).failure_class is FailureClass.WRONG_VALUE
