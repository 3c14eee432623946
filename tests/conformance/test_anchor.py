"""Re-anchored steps (conformance/oracle/anchor.py): each step is judged from the engine's own state,
a divergence is reported at its step, and the straight-through check stays as a second one.

No processes: records are made from the oracle itself (what a correct engine reports), then
one thing is changed.
"""

import copy

import pytest
import torch

from conformance.judge.compare import ConformanceError
from conformance.judge.contract import check_records
from conformance.oracle import baseline
from conformance.oracle.anchor import Anchor
from conformance.oracle.envelope import reference
from conformance.semantics import TORCH_DDP
from tests.conformance.area_cases import scenario

W3 = "ddp/plain/mlp/w3/fp32"  # continuous data, 3 steps, momentum SGD


def _records(b: baseline.Baseline) -> dict[int, dict]:
    out = {}
    for r in range(b.scenario.world_size):
        params, buffers = b.init_for(r)
        events = []
        for e in b.events:
            values = None if e.per_rank[r] is None else {n: reference(v) for n, v in e.per_rank[r].items()}
            ev = {"kind": e.kind, "step": e.step, "micro": e.micro, "synced": e.synced, "values": values}
            if e.kind == "step":
                ev["buffers"] = e.buffers[r] if e.buffers and e.buffers[r] is not None else {}
            events.append(ev)
        out[r] = {"init": {"parameters": params, "buffers": buffers}, "events": events, "error": None}
    return out


def _judge(s, records):
    anchored, straight = baseline.oracles(s, TORCH_DDP, records)
    return check_records(s, "meta", anchored, records, straight_through=straight)


def test_anchor_reads_params_buffers_and_grads_per_step():
    s = scenario(W3)
    records = _records(baseline.compute(s))
    anchor = Anchor(records, s.world_size)
    assert anchor.params_before(0) is None and anchor.params_before(1) is records[0]["events"][1]["values"]
    assert anchor.grads(0) is records[0]["events"][0]["values"]
    assert anchor.buffers_before(1) == [records[r]["events"][1]["buffers"] for r in range(3)]


def test_a_correct_engine_passes_and_the_report_names_the_rule():
    s = scenario(W3)
    checked = _judge(s, _records(baseline.compute(s)))
    oracle = checked.details["oracle"]
    assert oracle["kind"] == "summation-order" and oracle["steps"].startswith("re-anchored")
    assert oracle["envelopes"] > 0 and 0 < oracle["largest_bound_u"] < 8  # a few roundings of the shares
    assert oracle["straight_through"].startswith("within accumulated envelope")  # conformance.oracle.trajectory


def _shift_state(records, step, delta):
    """An engine whose parameters after `step` differ (consistently on every rank)."""
    for rec in records.values():
        for e in rec["events"]:
            if e["kind"] == "step" and e["step"] == step:
                e["values"] = {n: v + delta for n, v in e["values"].items()}
    return records


def test_a_wrong_step_is_caught_at_that_step_bitwise():
    s = scenario(W3)
    records = _shift_state(_records(baseline.compute(s)), 1, 1e-6)
    with pytest.raises(ConformanceError, match=r"after optimizer step 1: parameters differ"):
        _judge(s, records)


def test_later_steps_start_from_the_engine_state():
    """An engine whose step-0 state differs (consistently) from the oracle's: the re-anchored
    oracle's step-1 gradients are computed from the engine's parameters, not its own."""
    s = scenario(W3)
    records = _shift_state(_records(baseline.compute(s)), 0, 0.25)
    anchored = baseline.compute_anchored(s, TORCH_DDP, records)
    own = baseline.compute(s)
    step1 = next(i for i, e in enumerate(anchored.events) if e.kind == "backward" and e.step == 1)
    a = reference(anchored.events[step1].per_rank[0]["layers.0.weight"])
    b = reference(own.events[step1].per_rank[0]["layers.0.weight"])
    assert not torch.equal(a, b)


def test_one_ulp_in_one_gradient_at_the_last_step_is_caught_there():
    s = scenario(W3)
    records = _records(baseline.compute(s))
    anchored = baseline.compute_anchored(s, TORCH_DDP, records)
    last = max(i for i, e in enumerate(anchored.events) if e.kind == "backward")
    env = anchored.events[last].per_rank[0]["layers.0.weight"]
    single = int(((env.candidates == env.reference).all(0)).flatten().nonzero()[0])
    for rec in records.values():
        g = dict(rec["events"][last]["values"])
        w = g["layers.0.weight"].clone().view(-1)
        w[single] = torch.nextafter(w[single], torch.tensor(float("inf")))
        g["layers.0.weight"] = w.view_as(g["layers.0.weight"])
        rec["events"][last]["values"] = g
    with pytest.raises(ConformanceError, match=r"(?s)after backward \(step 2.*1 of 128 elements outside the envelope"):
        _judge(s, records)


def test_the_straight_through_check_fails_only_beyond_its_band_and_says_so():
    """Where the re-anchored oracle could not replay a step per summation order (no `reach`), the
    second check compares with the oracle trained from the seeds under the old band."""
    s = scenario(W3)
    records = _records(baseline.compute(s))
    anchored, straight = baseline.oracles(s, TORCH_DDP, records)
    anchored.reach = None
    drifted = copy.deepcopy(straight)
    last = drifted.events[-1]
    band = s.tolerance.straight_through
    nudge = {n: v * (1 + band.rtol / 2) for n, v in last.per_rank[0].items()}  # inside the band: passes
    last.per_rank = [nudge] * s.world_size
    assert check_records(s, "meta", anchored, records, straight_through=drifted).details["oracle"][
        "straight_through"].startswith("within")
    last.per_rank = [{n: v + 1.0 for n, v in nudge.items()}] * s.world_size  # beyond it
    with pytest.raises(ConformanceError, match=r"^straight-through check .*after optimizer step 2"):
        check_records(s, "meta", anchored, records, straight_through=drifted)


def test_one_step_under_a_derived_bound_implies_the_straight_through_check():
    """A declared reduce_dtype over three micro-batches, one step: both oracles start from
    construction, so the band (narrower than the bound where shares cancel) judges nothing new."""
    from conformance.semantics import with_reduce_dtype

    s = scenario("ddp/reduce-fp16-large-accumulated/mlp/w2/fp32")
    sem = with_reduce_dtype(TORCH_DDP, s)
    records = _records(baseline.compute(s, sem))
    anchored, straight = baseline.oracles(s, sem, records)
    checked = check_records(s, "meta", anchored, records, semantics=sem, straight_through=straight)
    assert checked.details["oracle"]["kind"] == "derived-bound"
    assert checked.details["oracle"]["straight_through"].startswith("implied: one step")
