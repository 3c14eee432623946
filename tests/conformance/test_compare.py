"""Comparison: verdicts and the information a failure message must carry."""

import torch

from conformance.judge.compare import compare_dicts, compare_tensor, failure_message
from conformance.spec import EXACT, Tolerance, float_tolerance


def test_exact_accepts_equal_and_rejects_one_ulp():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert compare_tensor("w", a, a.clone(), EXACT) is None
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(10.0))
    m = compare_tensor("w", a, b, EXACT)
    assert m is not None and m.worst_index == (1,)
    assert m.expected_value == 2.0 and m.actual_value == float(b[1])


def test_tolerance_band():
    tol = Tolerance(False, rtol=1e-3, atol=0.0)
    a = torch.tensor([100.0])
    assert compare_tensor("w", a, torch.tensor([100.05]), tol) is None
    assert compare_tensor("w", a, torch.tensor([100.2]), tol) is not None


def test_none_dtype_shape_and_names():
    a = torch.ones(2)
    assert "expected grad None" in compare_tensor("w", None, torch.zeros(2), EXACT).problem
    assert "got None" in compare_tensor("w", a, None, EXACT).problem
    assert "dtype" in compare_tensor("w", a, a.double(), EXACT).problem
    assert "shape" in compare_tensor("w", a, torch.ones(3), EXACT).problem
    problems = {m.name: m.problem for m in compare_dicts({"a": a, "b": a}, {"a": a, "c": a}, EXACT)}
    assert "missing" in problems["b"] and "unexpected" in problems["c"]


def test_failure_message_names_everything():
    m = compare_tensor("layers.0.weight", torch.zeros(2, 2), torch.tensor([[0.0, 0.0], [0.5, 0.0]]), EXACT)
    text = failure_message(scenario_id="ddp/x/mlp/w2/fp32", adapter="torch-ddp", rank=1, where="after optimizer step 0",
                           what="parameters differ", mismatches=[m], tol=EXACT, repro="gradparity run --scenario ddp/x")
    for needle in ("ddp/x/mlp/w2/fp32", "rank 1", "step 0", "layers.0.weight", "max abs err 0.5", "[1, 0]",
                   "expected 0.0, actual 0.5", "bitwise", "repro: gradparity run"):
        assert needle in text, needle


def test_float_tolerance_scales_with_summands():
    assert float_tolerance("float32", 4).rtol == 4 * float_tolerance("float32", 1).rtol
    assert float_tolerance("bfloat16", 2).rtol > float_tolerance("float16", 2).rtol


def test_each_failing_element_says_how_far_outside_the_rule_it_lies():
    from conformance.judge.compare import compare_tensor
    from conformance.spec import EXACT

    expected = torch.tensor([1.0, 2.0, 4.0, 8.0])
    actual = expected.clone()
    for i, ulps in ((0, 1), (1, 3), (3, 2)):
        for _ in range(ulps):
            actual[i] = torch.nextafter(actual[i], torch.tensor(float("inf")))
    m = compare_tensor("w", expected, actual, EXACT)
    text = m.render()
    assert "3 of 4 elements differ" in text and m.worst_index == (3,) and m.outside_ulps == 2.0
    assert "at [1]: expected 2.0" in text and "(3 ulps)" in text and "at [0]: expected 1.0" in text and "(1 ulps)" in text


def test_an_integer_buffer_mismatch_is_a_wrong_value_not_a_crash():
    from conformance.judge.compare import compare_tensor
    from conformance.spec import EXACT

    m = compare_tensor("bn.num_batches_tracked", torch.tensor(3), torch.tensor(4), EXACT)
    assert "1 of 1 elements differ" in m.render() and m.outside == 1.0 and m.outside_ulps == 1.0
    m = compare_tensor("mask", torch.tensor([True, False]), torch.tensor([True, True]), EXACT)
    assert m is not None and m.worst_index == (1,)


def test_a_difference_where_zero_was_expected_reads_as_no_ratio_not_a_huge_number():
    """An expected 0 has no ratio and no ulp scale: the message says so (it printed 8.99e+307, then
    `inf` even when the element shown as worst had a ratio, and 4.25e+37 ulps for an error of 0.5)."""
    m = compare_tensor("w", torch.tensor([0.0, 2.0]), torch.tensor([0.5, 2.0]), EXACT)
    assert m is not None and m.zero_expected == 1
    text = m.render()
    assert "max rel err n/a (every failing element expects 0)" in text and "e+307" not in text and "ulps" not in text
    m = compare_tensor("w", torch.tensor([0.0, -46.0]), torch.tensor([0.5, 12.0]), EXACT)
    text = m.render()
    assert "max rel err 1.26 (1 failing elements expect 0), worst at index [1]: expected -46.0" in text
    assert "at [0]: expected 0.0, actual 0.5, 0.5 outside;" in text + ";"
    m = compare_tensor("w", torch.tensor([0.0, 2.0]), torch.tensor([0.0, 3.0]), Tolerance())
    assert m is not None and m.max_rel == 0.5 and "max rel err 0.5," in m.render()
