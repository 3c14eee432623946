"""refimpl's ZeRO-3 engine (refimpl/sharded/zero3.py), in one 2-rank gloo world.

The ZeRO-2 engine is the reference here: same shard layout, same bucketer, same division
before the sum, so gradients and parameters after every backward and step must be *bitwise*
equal to it, whatever the units, resharding and call pattern (a unit called twice in one
forward, two forwards before one backward, no_sync accumulation). The suite's oracle checks
both engines against one process (gradparity run --adapter refimpl-zero3 -k sharded).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from refimpl.sharded import ShardedDataParallel
from refimpl.sharded.zero3 import FullyShardedDataParallel, MixedPrecisionPolicy
from tests.refimpl._refimpl_world import run_world


class Net(nn.Module):
    """Sizes 5x7, 7, 7x3 (not multiples of 2: padded chunks), a 0-dim parameter, a unit called twice."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Sequential(nn.Linear(5, 7), nn.Tanh())
        self.b = nn.Linear(7, 3)
        self.c = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.randn(()))

    def forward(self, x):
        return self.c(self.c(self.b(self.a(x)))) * self.scale


def _x(step, rank, k=0):
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + 10 * k + rank))


def _train(model, rank, two_forwards: bool):
    opt = model.make_optimizer(torch.optim.Adam, lr=0.01)
    record = []
    for step in range(3):
        with model.no_sync():
            (model(_x(step, rank, 1)) ** 2).mean().backward()
        if two_forwards:  # two forwards, one backward over both
            ((model(_x(step, rank)) ** 2).mean() + model(_x(step, rank, 2)).sum()).backward()
        else:
            (model(_x(step, rank)) ** 2).mean().backward()
        record.append(model.full_gradients())
        opt.step()
        opt.zero_grad()
        record.append(model.full_parameters())
    return record


def _matches_zero2(rank, world_size):
    failures = []
    for reshard in (True, False):
        for two_forwards in (False, True):
            net2, net3 = Net(rank), Net(rank)
            want = _train(ShardedDataParallel(net2), rank, two_forwards)
            z3 = FullyShardedDataParallel(net3, units=[net3.a, net3.c], reshard_after_forward=reshard)
            got = _train(z3, rank, two_forwards)
            for i, (w, g) in enumerate(zip(want, got, strict=True)):
                for name in w:
                    same = (w[name] is None and g[name] is None) or (
                        w[name] is not None and g[name] is not None and torch.equal(w[name], g[name]))
                    if not same:
                        failures.append(f"reshard={reshard} two_forwards={two_forwards} record {i} {name}")
            # At rest no parameter of the module holds values: that is the memory ZeRO-3 saves.
            held = [n for n, p in net3.named_parameters() if p.untyped_storage().nbytes()]
            if held:
                failures.append(f"parameters still hold storage at rest: {held}")
    return failures


def _mixed_precision(rank, world_size):
    """bf16 compute, fp32 reduce: the gradient is the fp32 mean of each rank's bf16 gradient."""
    net = Net(rank)
    ref = Net(0)  # rank 0's parameters everywhere after construction
    z3 = FullyShardedDataParallel(net, units=[net.a], mixed_precision=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    (z3(_x(0, rank)) ** 2).mean().backward()
    got = z3.full_gradients()
    expected = {}
    for r in range(world_size):
        low = Net(0).to(torch.bfloat16)
        low.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
        (low(_x(0, r).to(torch.bfloat16)) ** 2).mean().backward()
        for n, p in low.named_parameters():
            expected[n] = expected.get(n, 0) + p.grad.float() / world_size
    dtypes = {n: g.dtype for n, g in got.items()}
    worst = max((got[n] - expected[n]).abs().max().item() for n in got)
    return dtypes, worst, {n: p.dtype for n, p in z3.full_parameters().items()}


def _mixed_precision_no_sync(rank, world_size):
    """Inside no_sync() the local sum is kept in reduce_dtype (fp32), out of the bf16 p.grad;
    zero_grad() drops it (refimpl/sharded/precision.py)."""
    net = Net(rank)
    z3 = FullyShardedDataParallel(net, units=[net.a], mixed_precision=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    opt = z3.make_optimizer(torch.optim.SGD, lr=0.1)
    with z3.no_sync():
        for k in (1, 2, 3):
            (z3(_x(0, rank, k)) ** 2).mean().backward()
    held = {q.name: q.acc for q in z3._params}
    grads_in_param = [q.param.grad for q in z3._params]
    low = Net(0).to(torch.bfloat16)  # rank 0's parameters everywhere: the same sum in fp32 by hand
    low.load_state_dict({k: v.to(torch.bfloat16) for k, v in Net(0).state_dict().items()})
    want = {}
    for k in (1, 2, 3):
        low.zero_grad()
        (low(_x(0, rank, k).to(torch.bfloat16)) ** 2).mean().backward()
        for n, p in low.named_parameters():
            want[n] = p.grad.float() if n not in want else want[n] + p.grad.float()
    opt.zero_grad()
    cleared = all(q.acc is None for q in z3._params)
    return ({n: (t.dtype, torch.equal(t, want[n])) for n, t in held.items()}, grads_in_param, cleared)


def _state_dicts_and_clip(rank, world_size):
    net = Net(rank)
    z3 = FullyShardedDataParallel(net, units=[net.c])
    opt = z3.make_optimizer(torch.optim.SGD, lr=0.1)
    (z3(_x(0, rank)) ** 2).mean().backward()
    full_grads = z3.full_gradients()
    z2 = ShardedDataParallel(Net(rank))  # the ZeRO-2 engine's clip: same shards, same global norm
    (z2(_x(0, rank)) ** 2).mean().backward()
    z2_norm = z2.clip_grad_norm_(1e-3).item()
    norm = z3.clip_grad_norm_(1e-3)
    want_norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in full_grads.values()]))
    clipped = z3.full_gradients()
    ratio = {n: (clipped[n] / full_grads[n])[full_grads[n] != 0] for n in full_grads}
    opt.step()
    full = z3.full_state_dict()
    sharded = z3.sharded_state_dict()
    other = Net(7)
    z3b = FullyShardedDataParallel(other)
    z3b.load_full_state_dict(full)
    from_full = z3b.full_parameters()
    z3c = FullyShardedDataParallel(Net(9), units=[])
    z3c.load_sharded_state_dict(sharded)
    from_sharded = z3c.full_parameters()
    return {
        "norm": (norm.item(), want_norm.item()),
        "zero2_norm": z2_norm,
        "ratio_spread": max((r.max() - r.min()).item() for r in ratio.values() if r.numel()),
        "ratio": next(r[0].item() for r in ratio.values() if r.numel()),
        "full_round_trip": all(torch.equal(from_full[n], full[n]) for n in from_full),
        "sharded_round_trip": all(torch.equal(from_sharded[n], full[n]) for n in from_sharded),
    }


def _per_unit_reduction(rank, world_size):
    """What is alive when the first block's weight gradient arrives (the last one backward makes)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
    z3 = FullyShardedDataParallel(net, units=list(net))
    seen = {}

    def probe(_param):
        seen["full_grads"] = [i for i, blk in enumerate(net) if blk.weight.grad is not None]
        seen["gathered"] = [i for i, blk in enumerate(net) if blk.weight.untyped_storage().nbytes()]
        seen["sharded_grads"] = [i for i, blk in enumerate(net) if z3._units[i + 1].params[0].shard.grad is not None]

    net[0].weight.register_post_accumulate_grad_hook(probe)
    z3(_x(0, rank)[:, :1].expand(4, 6).contiguous()).sum().backward()
    return seen


def _reshard_to_group(rank, world_size):
    """At w4: reshard_after_forward=2 against True, the memory held after forward, and bad ints."""
    out = {"failures": []}
    for two_forwards in (False, True):
        want = _train(FullyShardedDataParallel(n1 := Net(rank), units=[n1.a, n1.c], reshard_after_forward=True),
                      rank, two_forwards)
        got = _train(FullyShardedDataParallel(n2 := Net(rank), units=[n2.a, n2.c], reshard_after_forward=2),
                     rank, two_forwards)
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            out["failures"] += [f"two_forwards={two_forwards} record {i} {n}" for n in w
                                if not ((w[n] is None and g[n] is None) or torch.equal(w[n], g[n]))]
    net = Net(rank)
    z3 = FullyShardedDataParallel(net, units=[net.a, net.b], reshard_after_forward=2)
    loss = (z3(_x(0, rank)) ** 2).mean()
    unit_b = next(u for u in z3._units if u.module is net.b)
    out["kept_numel"] = {str(d): t.numel() for d, t in unit_b.kept.items()}
    out["unit_b_numel"] = sum(q.chunk for q in unit_b.params) * world_size
    out["b_gathered_after_forward"] = bool(net.b.weight.untyped_storage().nbytes())
    loss.backward()
    out["kept_after_backward"] = bool(unit_b.kept)
    out["errors"] = {}
    for k in (3, 0, 5):
        try:
            FullyShardedDataParallel(Net(rank), reshard_after_forward=k)
        except ValueError as e:
            out["errors"][k] = str(e)
    out["read_as"] = {k: FullyShardedDataParallel(Net(rank), reshard_after_forward=k)._reshard_to for k in (1, 4)}
    return out


# One world per test, all on one xdist worker: a failing world is named by its own test (a
# module-wide fixture attributed any world's crash to whichever test set it up first).
_one_worker = pytest.mark.xdist_group("refimpl-zero3-worlds")


@_one_worker
def test_bitwise_equal_to_zero2_under_units_resharding_and_call_patterns():
    for rank, failures in enumerate(run_world(_matches_zero2, 2, timeout=180)):
        assert failures == [], f"rank {rank}: {failures}"


@_one_worker
def test_mixed_precision_reduces_bf16_gradients_in_fp32():
    for dtypes, worst, param_dtypes in run_world(_mixed_precision, 2, timeout=120):
        assert set(dtypes.values()) == {torch.float32}  # the shard's dtype, not the compute dtype
        assert set(param_dtypes.values()) == {torch.float32}
        # bf16 forward/backward on both sides with the same kernels; only the fp32 sum differs
        assert worst <= 1e-6, worst


@_one_worker
def test_mixed_precision_no_sync_sum_is_kept_in_reduce_dtype():
    for held, grads_in_param, cleared in run_world(_mixed_precision_no_sync, 2, timeout=120):
        assert held and all(v == (torch.float32, True) for v in held.values()), held
        assert grads_in_param == [None] * len(grads_in_param)  # moved out of the bf16 p.grad
        assert cleared


@_one_worker
def test_global_norm_clipping_and_state_dict_round_trips():
    for out in run_world(_state_dicts_and_clip, 2, timeout=120):
        got, want = out["norm"]
        assert math.isclose(got, want, rel_tol=1e-5), out  # the global norm, not this rank's shard's
        assert out["zero2_norm"] == got, out  # ZeRO-2's clip: the same shards, the same norm
        assert out["ratio_spread"] <= 1e-6 and out["ratio"] < 1.0, out  # one factor for every element
        assert out["full_round_trip"] and out["sharded_round_trip"], out


@_one_worker
def test_each_unit_is_reduced_and_freed_as_its_backward_ends():
    for seen in run_world(_per_unit_reduction, 2, timeout=120):
        # Blocks 1-3 (inputs that need a gradient) were reduce-scattered and freed before block 0's
        # backward ended: one unit's full gradients at a time, not the model's. Block 0 (its input
        # needs no gradient) is reduced at the end of backward.
        assert seen == {"full_grads": [0], "gathered": [0], "sharded_grads": [1, 2, 3]}, seen


@_one_worker
def test_reshard_after_forward_int_keeps_a_group_share_and_gathers_within_the_group():
    for out in run_world(_reshard_to_group, 4, timeout=240):
        assert out["failures"] == [], out["failures"]  # bitwise what True gives, at 4 ranks
        # after forward a resharded unit holds W/k = 2 of the 4 rows of its layout, no full parameter
        assert out["kept_numel"] == {"torch.float32": out["unit_b_numel"] // 2}, out
        assert not out["b_gathered_after_forward"] and not out["kept_after_backward"], out
        assert set(out["errors"]) == {3, 0, 5}, out
        assert all("divides the world size 4" in e for e in out["errors"].values()), out
        assert out["read_as"] == {1: False, 4: True}, out  # FSDP2's reading of 1 and W


def test_bad_options_say_what_to_do():
    with pytest.raises(AssertionError, match="init_process_group"):
        FullyShardedDataParallel(Net(0))
