"""conformance/oracle/trajectory.py: the straight-through check at 3+ ranks is judged by the
accumulated envelope. A correct engine's run meets it at every step (where the old band failed
it), and a broken engine's does not: a zero gradient at the first step, the stale-gradient
mutant from the step where its gradient goes stale."""

from __future__ import annotations

import copy

import torch

from conformance import mutants
from conformance.adapters.registry import ddp_class_spec
from conformance.judge.compare import ConformanceError, compare_dicts
from conformance.judge.contract import ACCUMULATED, check_records
from conformance.oracle import baseline, trajectory
from conformance.oracle.envelope import reduce
from conformance.pipeline import Case
from conformance.semantics import TORCH_DDP
from conformance.spec import summation_order
from tests.conformance.area_cases import scenario
from tests.conformance.test_anchor import _records

W3 = "ddp/plain/mlp/w3/fp32"  # continuous data, 3 steps, momentum SGD
LLAMA = "ddp/plain/llama/w3/fp32"  # 3 steps at 3 ranks (was limited to one by the band)


def _outside(s, records) -> list[str]:
    """Per event, where the accumulated envelope rejects rank 0's record (the straight-through check alone)."""
    anchored, straight = baseline.oracles(s, TORCH_DDP, records)
    envelope = trajectory.accumulated(anchored, straight)
    assert envelope is not None, "the re-anchored oracle replayed every step per summation order"
    return [e.where() for i, e in enumerate(envelope.events)
            if compare_dicts(e.per_rank[0], records[0]["events"][i]["values"], ACCUMULATED)]


def test_the_reach_replays_every_candidate_and_restores_the_optimizer():
    s = scenario(W3)
    records = _records(baseline.compute(s))
    anchored = baseline.compute_anchored(s, TORCH_DDP, records)
    assert sorted(anchored.reach) == list(range(s.steps))
    widths = [float(w.max()) for step in anchored.reach.values() for _, w in step.values()]
    assert max(widths) > 0  # some element's order choice moves the step
    again = baseline.compute_anchored(s, TORCH_DDP, records)  # the real steps are unchanged by the replays
    assert all(torch.equal(a, b) for e, f in zip(anchored.events, again.events, strict=True)
               for a, b in zip(e.per_rank[0].values(), f.per_rank[0].values(), strict=True) if isinstance(a, torch.Tensor))


def test_a_derived_radius_is_replayed_by_its_ends_for_sgd_only():
    """Six shares (3 ranks x 2 micro-batches reduced one by one) have a radius, not enumerated orders:
    SGD's step is monotone per element, so the radius's ends bound it; Adam's is not (the band judges)."""
    torch.manual_seed(0)
    env = reduce([torch.randn(5) for _ in range(6)], 3, summation_order("float32", 3))
    assert env.radius is not None
    p = torch.nn.Parameter(torch.zeros(5))
    sgd = torch.optim.SGD([p], lr=0.5, momentum=0.5)
    assert trajectory.replayable({"p": env}, sgd) and not trajectory.replayable({"p": env}, torch.optim.Adam([p]))
    lo, hi = trajectory._accepted(env)[-2:]
    assert (lo.double() <= env.center - env.radius).all() and (hi.double() >= env.center + env.radius).all()
    ((ref, width),) = trajectory.reach(sgd, [("p", p)], {"p": env}).values()
    assert torch.equal(p.detach(), torch.zeros(5)) and not sgd.state  # the replays leave no trace
    g = env.reference.double()
    assert torch.equal(ref, -0.5 * env.reference)  # the first momentum step is -lr * g, exactly
    assert (width >= 0.5 * torch.maximum(hi.double() - g, g - lo.double())).all()


def test_a_zero_gradient_is_outside_the_accumulated_envelope():
    s = scenario(W3)
    records = _records(baseline.compute(s))
    for rec in records.values():  # an engine that reduces nothing at the first step
        first = rec["events"][0]
        first["values"] = {n: torch.zeros_like(v) for n, v in first["values"].items()}
    assert _outside(s, records)[0] == "after backward (step 0, micro-batch 0, synced)"


def test_a_correct_engine_stays_in_the_accumulated_envelope_where_the_band_failed_it(session):
    s = scenario(LLAMA)
    records = session.run(Case(s, "torch-ddp").area, s, "torch-ddp").values
    assert _outside(s, records) == []
    anchored, straight = baseline.oracles(s, TORCH_DDP, records)
    checked = check_records(s, "torch-ddp", anchored, records, straight_through=straight)
    assert checked.details["oracle"]["straight_through"].startswith("within accumulated envelope")
    banded = copy.copy(anchored)
    banded.reach = None  # the old straight-through band: a false failure after the first step
    try:
        check_records(s, "torch-ddp", banded, records, straight_through=straight)
    except ConformanceError as exc:
        assert str(exc).startswith("straight-through check") and "(step 0" not in str(exc).split("\n")[0]
    else:
        raise AssertionError("expected the band to fail torch-ddp's correct 3-step run at 3 ranks")


def test_the_stale_gradient_mutant_leaves_it_at_its_first_stale_step(session):
    s = scenario(LLAMA)
    spec = ddp_class_spec(mutants.MUTANTS["stale-gradient"][0])
    records = session.run(Case(s, spec).area, s, spec).values
    outside = _outside(s, records)
    assert outside and outside[0] == "after backward (step 1, micro-batch 0, synced)", outside
