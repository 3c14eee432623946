"""ShardedDataParallel against a single-process baseline, after every backward and every step.

One 3-rank gloo world runs every check on groups of size 1, 2 and 3 (spawning costs ~3 s a
world). Each rank computes the baseline itself: the same model from rank 0's seed, one
backward over ``(1/W) Σ_r loss(x_r, rank=r)`` per micro-batch, the same optimizer.
Group sizes 1 and 2 must match bitwise (a division by 1 or 2 is exact and the per-rank
gradients are computed by the same kernels) until the first no_sync() accumulation; from
then on a small tolerance: with W=2 the sharded model sums micro-batches per rank before the
ranks (Σ_r (Σ_k g_rk)/W) while the baseline sums ranks per micro-batch (Σ_k Σ_r g_rk/W),
a different rounding order. Size 3 divides by 3, rounding differently from the baseline's
multiplication by 1/3, so it always gets the tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from refimpl.sharded import ShardedDataParallel
from tests.refimpl._refimpl_world import run_world

WORLD_TIMEOUT_S = 90


# --- model, data, baseline ----------------------------------------------------------------
class Net(nn.Module):
    """Uneven sizes (not multiples of 2 or 3), a 0-dim and a float64 parameter, a parameter
    only rank 1 uses, one nobody uses, and a rank-dependent buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = nn.Linear(5, 7)
        self.l2 = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.randn(()))
        self.p64 = nn.Parameter(torch.randn(5, dtype=torch.float64))
        self.only_rank1 = nn.Parameter(torch.randn(3))
        self.unused = nn.Parameter(torch.randn(2, 2))
        self.register_buffer("offset", torch.full((3,), float(seed)))

    def forward(self, x, rank):
        y = self.l2(torch.tanh(self.l1(x))) * self.scale
        # Each parameter is used once per forward: a parameter used twice gets several
        # gradient contributions per rank, and the baseline sums all ranks' contributions in
        # one order while the sharded model sums per rank first — not bitwise comparable.
        y = y + self.p64.square().sum().float() + self.offset * 0.0
        if rank == 1:
            y = y * self.only_rank1
        return y


def _loss(model, x, rank):
    return (model(x, rank=rank) ** 2).mean()


def _batch(step, micro, rank):
    g = torch.Generator().manual_seed(10_000 + 100 * step + 10 * micro + rank)
    return torch.randn(2 + rank, 5, generator=g)  # unequal shard sizes per rank


# (micro-batches inside no_sync before the synced one, synced backwards before the step)
SCHEDULE = [(0, 1), (0, 2), (2, 1), (1, 1), (0, 1)]
CONFIGS = [  # optimizer, kwargs, bucket_cap_mb
    (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}, 25),
    (torch.optim.Adam, {"lr": 0.01}, 1 / 4096),  # 256-byte buckets: flushes mid-backward
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}, 0),  # bucketing off
]


def _compare(label, got, want, exact):
    assert got.keys() == want.keys(), f"{label}: names {sorted(got)} != {sorted(want)}"
    for name, w in want.items():
        g = got[name]
        assert (g is None) == (w is None), (
            f"{label} {name}: grad is {'None' if g is None else 'set'}, baseline "
            f"{'None' if w is None else 'set'}")
        if w is None:
            continue
        if exact:
            ok = torch.equal(g, w)
        else:
            ok = torch.allclose(g, w, rtol=1e-5, atol=1e-6)
        if not ok:
            diff = (g.double() - w.double()).abs()
            i = int(diff.argmax())
            raise AssertionError(
                f"{label} {name}: max abs err {diff.max().item():.3g} at flat index {i}: "
                f"got {g.flatten()[i].item()!r}, expected {w.flatten()[i].item()!r} "
                f"({'bitwise' if exact else 'rtol=1e-5, atol=1e-6'})")


def _sharded_run(rank, W, group, opt_cls, opt_kwargs, cap):
    """One training run; returns per-check snapshots for cross-rank comparison."""
    exact = W in (1, 2)
    model = ShardedDataParallel(Net(seed=1000 + rank), process_group=group, bucket_cap_mb=cap)
    base = Net(seed=1000)  # rank 0's initialisation
    _compare("after construction", model.full_parameters(), dict(base.named_parameters()), True)
    assert torch.equal(model.module.offset, base.offset), "buffer not broadcast from rank 0"
    opt = model.make_optimizer(opt_cls, **opt_kwargs)
    base_opt = opt_cls(base.parameters(), **opt_kwargs)
    snapshots = []
    for step, (n_local, n_synced) in enumerate(SCHEDULE):
        exact = exact and (W == 1 or n_local == 0)  # see the module docstring
        micro = 0
        for _ in range(n_local):
            with model.no_sync():
                _loss(model, _batch(step, micro, rank), rank).backward()
            assert any(p.grad is not None for p in model.module.parameters()), (
                "no_sync() backward must keep local gradients")
            micro += 1
        for _ in range(n_synced):
            _loss(model, _batch(step, micro, rank), rank).backward()
            micro += 1
            assert model.bucketer.memory_bytes() == 0, "bucket memory held after backward"
            assert all(p.grad is None for p in model.module.parameters()), (
                "full p.grad must be freed once reduced")
        for m in range(micro):  # baseline: the same micro-batches, one backward each
            (sum(_loss(base, _batch(step, m, r), r) for r in range(W)) / W).backward()
        label = f"W={W} {opt_cls.__name__} cap={cap} step {step} ({'bitwise' if exact else 'tol'})"
        grads = model.full_gradients()
        _compare(f"{label} grads", grads, {n: p.grad for n, p in base.named_parameters()}, exact)
        opt.step()
        base_opt.step()
        params = model.full_parameters()
        _compare(f"{label} params", params, dict(base.named_parameters()), exact)
        opt.zero_grad()
        base_opt.zero_grad()
        snapshots.append((grads, params))
    return snapshots


def _sharded_checks_all_sizes(rank, world_size):
    done = {}
    for size in range(1, world_size + 1):
        members = list(range(size))
        group = dist.group.WORLD if size == world_size else dist.new_group(members)
        if rank not in members:
            continue
        for opt_cls, kwargs, cap in CONFIGS:
            key = (size, opt_cls.__name__)
            done[key] = _sharded_run(dist.get_rank(group), size, group, opt_cls, kwargs, cap)
    # misuse: stepping while a reduction is queued is refused with an actionable message
    model = ShardedDataParallel(Net(seed=rank), bucket_cap_mb=1)
    opt = model.make_optimizer(torch.optim.SGD, lr=0.1)
    # runs after the model's own hook on this parameter, i.e. with the reduction queued
    model.module.l2.weight.register_post_accumulate_grad_hook(lambda p: opt.step())
    loss = _loss(model, _batch(0, 0, rank), rank)
    with pytest.raises(AssertionError, match=r"after loss.backward\(\) has returned"):
        loss.backward()
    with pytest.warns(UserWarning, match="previous backward did not finish"):
        model(_batch(0, 0, rank), rank=rank)
    return done


@pytest.mark.slow
def test_sharded_matches_single_process_baseline(tmp_path):
    results = run_world(_sharded_checks_all_sizes, 3, timeout=WORLD_TIMEOUT_S)
    for size in (1, 2, 3):
        members = range(size)
        for opt_cls, _, _ in CONFIGS:
            key = (size, opt_cls.__name__)
            runs = [results[r][key] for r in members]
            assert len(runs[0]) == len(SCHEDULE), f"{key}: only {len(runs[0])} steps ran"
            # contract 4: grads and params bitwise identical across the group's ranks
            for r, run in zip(members, runs, strict=True):
                for step, ((g, p), (g0, p0)) in enumerate(zip(run, runs[0], strict=True)):
                    for name in p0:
                        assert torch.equal(p[name], p0[name]), f"{key} step {step} rank {r} {name}"
                        assert (g[name] is None and g0[name] is None) or torch.equal(
                            g[name], g0[name]), f"{key} step {step} rank {r} grad {name}"
