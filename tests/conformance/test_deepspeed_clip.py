"""DeepSpeed's clipping replay (conformance/oracle/declared/deepspeed_clip.py) and the ZeRO 1-3 adapters' per-scenario
loop, semantics and skips (no processes; the engine runs are `gradparity run --adapter deepspeed-zero*`)."""

from __future__ import annotations

import copy

import pytest
import torch

from conformance.adapters import registry
from conformance.adapters.engines import deepspeed as deepspeed_adapter
from conformance.adapters.engines import deepspeed_stage0
from conformance.adapters.protocol import owned
from conformance.catalogue import ddp
from conformance.oracle.accumulation import reduced_per_micro_batch
from conformance.oracle.declared import deepspeed_clip
from conformance.semantics import Accumulation, MidAccumulation, Precision, Scaling


def _grads(seed: int = 0, scale: float = 40.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * scale for shape in ((16, 8), (16,), (16, 16), (16,), (1, 16), (1,))]


def test_partitions_cover_every_element_once_in_parameter_order():
    grads = _grads()
    total = sum(g.numel() for g in grads)
    for world in (1, 2, 3, 4):
        pieces = deepspeed_clip.partition_pieces(grads, world)
        flat = torch.cat([p for mine in pieces for p in mine])
        assert torch.equal(flat, torch.cat([g.reshape(-1) for g in grads])) and flat.numel() == total


def test_the_replays_clip_to_the_max_norm_and_leave_small_gradients_alone():
    for replay in (deepspeed_clip.stage0, deepspeed_clip.zero12, deepspeed_clip.zero3):
        grads = _grads()
        replay(grads, 4.0, 2)
        norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
        assert abs(norm.item() - 4.0) < 1e-4
        small = _grads(scale=1e-3)
        before = [g.clone() for g in small]
        replay(small, 4.0, 2)
        assert all(torch.equal(a, b) for a, b in zip(small, before, strict=True))  # coefficient exactly 1


def test_the_replays_are_not_torchs_clip():
    """The declared difference is real: on some gradients torch's clip_grad_norm_ rounds differently,
    so judging DeepSpeed by torch's arithmetic (the old strict xfails) was a false failure."""
    differs = {"stage0": False, "zero12": False, "zero3": False}
    for seed in range(40):
        ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in _grads(seed)]
        for p, g in zip(ref, _grads(seed), strict=True):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(ref, 4.0)
        for name, replay in (("stage0", deepspeed_clip.stage0), ("zero12", deepspeed_clip.zero12),
                             ("zero3", deepspeed_clip.zero3)):
            grads = _grads(seed)
            replay(grads, 4.0, 2)
            differs[name] |= any(not torch.equal(g, p.grad) for g, p in zip(grads, ref, strict=True))
    assert differs == {"stage0": True, "zero12": True, "zero3": True}


def test_reduced_each_micro_batch_is_that_order_not_the_local_one():
    """ZeRO-2/3 average every micro-batch across ranks, then add: (a1+b1)+(a2+b2), not (a1+a2)+(b1+b2)."""
    a1, b1, a2, b2 = (torch.tensor([v], dtype=torch.float32) for v in (1.0, 1.0, 2.0**-23, 3 * 2.0**-24))
    shares = [[{"w": a1}, {"w": b1}], [{"w": a2}, {"w": b2}]]  # [micro][rank]
    got = reduced_per_micro_batch(shares, 2)["w"]
    assert torch.equal(got, (a1 / 2 + b1 / 2) + (a2 / 2 + b2 / 2))
    assert not torch.equal(got, (a1 + a2) / 2 + (b1 + b2) / 2)


@pytest.fixture(autouse=True)
def _a_cpu_with_fp16(monkeypatch):
    """These tests judge the plan's reasons, not this CPU: where oneDNN has no fp16 (this machine,
    CI's), DeepSpeed's CPU accelerator refuses fp16 and the adapter skips it (test_engines.py)."""
    for module in (deepspeed_adapter, deepspeed_stage0):
        monkeypatch.setattr(module, "fp16_refused_here", lambda scenario: None)


def _planned(name: str):
    """The adapter as planning sees it with DeepSpeed installed: these tests judge the plan's
    reasons, not this machine's install (CI's test env has no DeepSpeed)."""
    adapter = copy.copy(registry.load(name))  # a copy: the cached adapter keeps its install check
    adapter._why = None
    return adapter


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_use_deepspeeds_own_loop_only_where_its_semantics_need_it(stage):
    adapter = _planned(f"deepspeed-zero{stage}")
    plain = ddp.make("plain", "mlp")
    assert owned(adapter, plain) == {"optimizer"}  # the user's plain loop, where FairScale#354-like bugs show
    bf16 = plain.with_(dtype="bfloat16")
    assert owned(adapter, bf16) == {"optimizer", "backward"}
    assert adapter.semantics_for(bf16).precision == Precision.FP32_MASTER
    gas = ddp.make("gas-bf16", "mlp", dtype="bfloat16", micro_batches=2)
    sem = adapter.semantics_for(gas)
    assert sem.accumulation == Accumulation.MEAN
    assert sem.mid_accumulation == (MidAccumulation.REDUCED if stage > 1 else MidAccumulation.LOCAL)
    fp16 = plain.with_(dtype="float16")
    assert adapter.unavailable(fp16) is None and adapter.semantics_for(fp16).loss_scaler is not None  # replayed
    assert adapter.unavailable(gas.with_(dtype="float16")) is None  # loss / GAS scaled by S, replayed
    assert "powers of two" in adapter.unavailable(ddp.make("no-sync", "mlp", dtype="bfloat16", micro_batches=3))


def test_clipping_is_declared_for_the_replayed_stages_and_refused_beyond_two_ranks():
    clip = ddp.make("plain", "mlp").with_(features=(("clip", 4.0),))
    zero0 = _planned("deepspeed-zero0")
    assert zero0.semantics_for(clip).clipping is deepspeed_clip.STAGE0
    # stage 0 multiplies the all-reduced sum by fl(1/W): declared post-scaling, so 3+ ranks are judged
    assert zero0.semantics.scaling == Scaling.POST and zero0.unavailable(clip.with_(world_size=4)) is None
    assert zero0.semantics_for(clip.with_(dtype="float16", features=())).loss_scaler is not None  # then a strict xfail
    for stage, rule in ((1, deepspeed_clip.ZERO12), (2, deepspeed_clip.ZERO12), (3, deepspeed_clip.ZERO3)):
        adapter = _planned(f"deepspeed-zero{stage}")
        assert adapter.semantics_for(clip).clipping is rule
        assert adapter.unavailable(clip.with_(world_size=3)) is None  # judged by the derived bound (below)
        assert rule.exact(2) and not rule.exact(3)


def _sum_in(order):
    """An all-reduce that adds the ranks' partial norms in `order` (a left fold), or as the pairs ((0,1),(2,3))."""
    def reduce(parts):
        if order == "pairs":
            return (parts[0] + parts[1]) + (parts[2] + parts[3])
        total = parts[order[0]]
        for r in order[1:]:
            total = total + parts[r]
        return total
    return reduce


def _clipped_sgd_step(grads, replay, max_norm, world_size):
    """One engine step: the replayed clip on the (replicated) gradients, then SGD with momentum from zeros."""
    params = [torch.nn.Parameter(torch.full_like(g, 0.5)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    replay([p.grad for p in params], max_norm, world_size)
    torch.optim.SGD(params, lr=2.0**-10, momentum=0.9).step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("replay", [deepspeed_clip.zero12, deepspeed_clip.zero3], ids=["zero12", "zero3"])
def test_beyond_two_ranks_every_order_of_the_partial_norms_is_within_the_derived_bound_and_a_local_norm_is_not(
        replay, monkeypatch):
    """At 4 ranks gloo picks the order of the partial norms: every order (and a pairwise tree) lands within
    `conformance.oracle.clip_bound`'s bound around the oracle's torch-clipped step, an engine that clips each rank
    by its own partition's norm (no all-reduce) does not."""
    import itertools

    from conformance.oracle.clip_bound import ClipBound

    W, max_norm = 4, 1.0
    for seed in range(3):
        grads = _grads(seed)
        oracle = [torch.nn.Parameter(torch.full_like(g, 0.5)) for g in grads]
        opt = torch.optim.SGD(oracle, lr=2.0**-10, momentum=0.9)
        bound = ClipBound(max_norm, opt)
        for p, g in zip(oracle, grads, strict=True):
            p.grad = g.clone()
        bound.before_clip(oracle)
        bound.check_norm(float(torch.nn.utils.clip_grad_norm_(oracle, max_norm)))
        opt.step()
        radius = bound.after_step([(str(i), p) for i, p in enumerate(oracle)])
        assert bound.interval[1] < 1.0  # the clip is active

        def within(params, oracle=oracle, radius=radius):
            return all(bool(((e.double() - o.detach().double()).abs() <= radius[str(i)]).all())
                       for i, (e, o) in enumerate(zip(params, oracle, strict=True)))

        orders = [*itertools.permutations(range(W)), "pairs"]
        for order in orders:
            monkeypatch.setattr(deepspeed_clip, "_allreduce_sum", _sum_in(order))
            assert within(_clipped_sgd_step(grads, replay, max_norm, W)), (seed, order)
        monkeypatch.setattr(deepspeed_clip, "_allreduce_sum", lambda parts: parts[0])  # the local norm
        assert not within(_clipped_sgd_step(grads, replay, max_norm, W)), seed


def test_the_bf16_optimizer_variant_runs_bf16_only_accumulates_in_fp32_and_reduces_in_bf16():
    """deepspeed-zero1-fp32acc (PR #7985's configuration): between boundaries each rank's own fp32 running
    sum, at the boundary the average of the sums cast to bf16 (DeepSpeed's communication_data_type)."""
    from conformance.oracle.baseline import compute
    from conformance.oracle.envelope import reference

    adapter = _planned("deepspeed-zero1-fp32acc")
    assert "bf16 parameters only" in adapter.unavailable(ddp.make("plain", "mlp"))
    gas = ddp.make("gas-bf16", "mlp", dtype="bfloat16", micro_batches=2)
    assert adapter.unavailable(gas) is None and owned(adapter, gas) == {"optimizer", "backward"}
    sem = adapter.semantics_for(gas)
    assert sem.precision == Precision.FP32_MASTER_FP32_ACCUMULATION and sem.accumulation == Accumulation.MEAN
    ours = [e for e in compute(gas, sem).events if e.kind == "backward"]
    bf16 = [e for e in compute(gas, _planned("deepspeed-zero1").semantics_for(gas)).events if e.kind == "backward"]
    for mine, theirs in zip(ours, bf16, strict=True):
        for name, value in mine.per_rank[0].items():
            value, other = reference(value), reference(theirs.per_rank[0][name])
            if mine.synced:
                assert value.dtype == torch.bfloat16, name
            else:  # the rank's fp32 accumulator, not the bf16 gradient
                assert value.dtype == torch.float32 and torch.equal(value, other.float()), name
