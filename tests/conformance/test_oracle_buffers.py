"""conformance.oracle.buffers: which buffers each rank forwards from, replayed by both oracles
and checked against each rank's forwards computed by hand (no processes)."""

import torch

from conformance.models.data import build_model, make_inputs, model_loss
from conformance.oracle import baseline
from conformance.oracle import buffers as rule
from conformance.semantics import TORCH_DDP, Buffers, Semantics
from conformance.spec import Scenario, WrapOptions

OFF = WrapOptions(broadcast_buffers=False)
ON = WrapOptions()


def _scenario(model="cnn-bn", *, micro=1, steps=1, options=ON, features=()):
    return Scenario(f"ddp/t-buffers/{model}/w2/fp32/m{micro}-{options.broadcast_buffers}-{len(features)}", "ddp",
                    model, world_size=2, steps=steps, micro_batches=micro, options=options, seed=5,
                    features=features)


def _by_hand(s, rank: int, start_rank: int | None, broadcast_first: bool) -> dict:
    """Rank `rank`'s buffers after its forwards of step 0: rank 0's parameters; the buffers of
    `start_rank`'s construction (None: its own); rank 0's before the first micro-batch if
    `broadcast_first`, else before every one (the rule torch DDP does NOT follow under no_sync)."""
    model = build_model(s.model, s.kwargs(), seed=s.seed, rank=0)
    own = build_model(s.model, s.kwargs(), seed=s.seed, rank=rank if start_rank is None else start_rank)
    rank0 = build_model(s.model, s.kwargs(), seed=s.seed, rank=0)
    with torch.no_grad():
        for b, o in zip(model.buffers(), own.buffers(), strict=True):
            b.copy_(o)
    for micro in range(s.micro_batches):
        if not broadcast_first and micro > 0:  # the wrong rule: rank 0's buffers before every forward
            (x0,) = make_inputs(s.model, seed=s.seed, rank=0, step=0, micro=micro - 1, size=s.shard_size(0))
            model_loss(rank0, s.model, x0, rank=0, micro=micro - 1)
            with torch.no_grad():
                for b, o in zip(model.buffers(), rank0.buffers(), strict=True):
                    b.copy_(o)
        (x,) = make_inputs(s.model, seed=s.seed, rank=rank, step=0, micro=micro, size=s.shard_size(rank))
        model_loss(model, s.model, x, rank=rank, micro=micro)
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_rule_reads_broadcast_buffers():
    assert rule.rule(_scenario(options=OFF), TORCH_DDP) == Buffers.NEVER
    assert rule.rule(_scenario(), TORCH_DDP) == Buffers.BEFORE_FORWARD
    own = Semantics(buffers=Buffers.CONSTRUCTION_ONLY)
    assert rule.rule(_scenario(options=OFF), own) == Buffers.CONSTRUCTION_ONLY, "no broadcast to turn off"
    assert "broadcast_buffers=False" in rule.describe(_scenario(options=OFF), TORCH_DDP)
    assert [rule.broadcasts(m) for m in range(3)] == [True, False, False]


def test_broadcast_off_every_rank_keeps_its_own_buffers():
    s = _scenario(options=OFF)
    b = baseline.compute(s)
    own = [{n: t.detach() for n, t in build_model(s.model, {}, seed=s.seed, rank=r).named_buffers()} for r in (0, 1)]
    assert not _equal(own[0], own[1]), "the model's buffers must be rank-dependent for this test to mean anything"
    assert _equal(b.init_for(1)[1], own[1]) and _equal(b.init_for(0)[1], own[0]), "no sync at construction"
    step = next(e for e in b.events if e.kind == "step")
    for r in (0, 1):
        assert _equal(step.buffers[r], _by_hand(s, r, start_rank=None, broadcast_first=True))
    on = next(e for e in baseline.compute(_scenario()).events if e.kind == "step")
    assert not _equal(on.buffers[1], step.buffers[1]), "broadcasting on: rank 1 forwards from rank 0's buffers"


def test_no_sync_forwards_keep_the_ranks_own_buffers():
    s = _scenario(micro=3)
    step = next(e for e in baseline.compute(s).events if e.kind == "step")
    torch_rule = _by_hand(s, 1, start_rank=0, broadcast_first=True)
    every_forward = _by_hand(s, 1, start_rank=0, broadcast_first=False)
    assert not _equal(torch_rule, every_forward), "the two rules must differ here for the test to mean anything"
    assert _equal(step.buffers[1], torch_rule)
    assert _equal(step.buffers[0], _by_hand(s, 0, start_rank=0, broadcast_first=True))


def test_production_loop_models_both():
    """The production-training oracle (a feature: clipping far above the norm) replays the same rules."""
    feats = (("clip", 2.0**20),)
    for s, start in ((_scenario(options=OFF, features=feats), None), (_scenario(micro=3, features=feats), 0)):
        b = baseline.compute(s)
        step = next(e for e in b.events if e.kind == "step")
        for r in (0, 1):
            assert _equal(step.buffers[r], _by_hand(s, r, start_rank=start, broadcast_first=True)), (s.id, r)


def test_a_broadcast_after_backward_turned_off_is_construction_only():
    """pytorch-pfn-extras syncs buffers in its constructor and broadcasts after backward only when
    asked: off, each rank starts from rank 0's buffers and keeps its own updates (plain loop)."""
    after = Semantics(buffers=Buffers.AFTER_BACKWARD)
    s = _scenario(options=OFF)
    assert rule.rule(s, after) == Buffers.CONSTRUCTION_ONLY
    step = next(e for e in baseline.compute(s, after).events if e.kind == "step")
    for r in (0, 1):
        assert _equal(step.buffers[r], _by_hand(s, r, start_rank=0, broadcast_first=True))
    on = next(e for e in baseline.compute(_scenario(), after).events if e.kind == "step")
    assert _equal(on.buffers[1], on.buffers[0]), "on: rank 0's buffers broadcast after backward"
