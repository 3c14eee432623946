"""Each independent DDP mutant is genuinely buggy: shown outside the suite in a 2-rank gloo world,
by probes compared with the unmutated engine (itself checked against sums by hand)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from conformance.mutants.independent import ddp as zoo
from conformance.spec import WrapOptions
from tests.conformance.independent_results import same as _same
from tests.refimpl._refimpl_world import run_world

pytestmark = pytest.mark.slow

W = 2


class Net(nn.Module):
    """loss = linear(x, w) * count (+ extra . x where used); a rank-dependent construction."""

    def __init__(self, rank, dtype=torch.float32):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), float(rank + 1), dtype=dtype))
        self.extra = nn.Parameter(torch.full((4,), float(rank + 2), dtype=dtype))
        self.register_buffer("count", torch.tensor(float(rank + 1), dtype=dtype))

    def forward(self, x, *, rank=0, micro=0, use_extra=None, as_dict=False):
        lin = F.linear(x.view(1, 4), self.w.view(1, 4))
        loss = lin.sum() * self.count
        if (rank == 1) if use_extra is None else use_extra:
            loss = loss + (self.extra * x).sum()
        return {"loss": loss, "lin": lin} if as_dict else loss


def _x(rank, step, dtype=torch.float32, third=False):
    x = torch.arange(4, dtype=dtype) + rank + 2 * step
    return x / 3 if third else x


def _wrap(adapter, model, **options):
    ctx = SimpleNamespace(group=dist.group.WORLD, device=torch.device("cpu"))
    return adapter.wrap(model, ctx, WrapOptions(find_unused_parameters=True, **options))


def _forward_in_no_sync(a, rank):  # its backward outside no_sync: accumulates locally
    w = _wrap(a, Net(rank))
    with w.no_sync():
        loss = w(_x(rank, 0), rank=rank)
    loss.backward()
    return w.full_gradients()


def _accumulate(a, rank):  # two synced backwards, no zero_grad, gradients as bucket views
    w = _wrap(a, Net(rank), gradient_as_bucket_view=True)
    for step in range(2):
        w(_x(rank, step), rank=rank).backward()
    return w.full_gradients()


def _buffers_second_forward(a, rank):
    w = _wrap(a, Net(rank))
    w(_x(rank, 0), rank=rank).backward()
    with torch.no_grad():
        w.module.count.add_(rank)  # a rank-local change between forwards (as BatchNorm's stats)
    return w(_x(0, 0), use_extra=False).detach()


def _used_in_no_sync_only(a, rank):  # extra used in micro-batch 0 (no_sync) only, on every rank
    w = _wrap(a, Net(rank))
    with w.no_sync():
        w(_x(rank, 0), use_extra=True).backward()
    w(_x(rank, 1), use_extra=False).backward()
    return w.full_gradients()


def _unused_changes(a, rank):  # extra unused at step 0, used at step 1
    w = _wrap(a, Net(rank))
    w(_x(rank, 0), use_extra=False).backward()
    w.zero_grad()
    w(_x(rank, 1), use_extra=True).backward()
    return w.full_gradients()


def _dict_output(a, rank):
    w = _wrap(a, Net(rank))
    w(_x(rank, 0), rank=rank, as_dict=True)["loss"].backward()
    return w.full_gradients()


def _kwargs_in_no_sync(a, rank):
    w = _wrap(a, Net(rank))
    with w.no_sync():
        w(_x(rank, 0), rank=rank).backward()
    return w.full_gradients()


def _autocast(a, rank):
    w = _wrap(a, Net(rank))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return w(_x(rank, 0), rank=rank, as_dict=True)["lin"].dtype


def _fp64(a, rank):
    w = _wrap(a, Net(rank, torch.float64))
    w(_x(rank, 0, torch.float64, third=True), rank=rank).backward()
    return w.full_gradients()


def _join(a, rank):  # rank 0 runs out of data first
    w = _wrap(a, Net(rank))
    opt = torch.optim.SGD(w.optimizer_parameters(), lr=0.5)
    with w.ddp.join():
        for step in range(1 + rank):
            w(_x(rank, step), use_extra=False).backward()
            opt.step()
            opt.zero_grad()
    return w.full_parameters()


PROBES = {"forward-in-no-sync": _forward_in_no_sync, "accumulate": _accumulate,
          "buffers-second-forward": _buffers_second_forward, "used-in-no-sync-only": _used_in_no_sync_only,
          "unused-changes": _unused_changes, "dict-output": _dict_output, "kwargs-in-no-sync": _kwargs_in_no_sync,
          "autocast": _autocast, "fp64": _fp64, "join": _join}


def _probes(adapter, rank, only=None):
    """Every probe's result; a probe that raises records the error (both ranks raise alike)."""
    out = {}
    for name, fn in PROBES.items():
        if only is None or name in only:
            try:
                out[name] = fn(adapter, rank)
            except Exception as exc:  # noqa: BLE001 - a raise is a behaviour to compare
                out[name] = f"raised {type(exc).__name__}"
    return out


def _rank_main(rank, world_size, names, only):
    return {n: _probes(zoo.correct() if n == "correct" else zoo.MUTANTS[n](), rank, only) for n in names}


def test_correct_by_hand():
    res = run_world(_rank_main, W, ["correct"], None, timeout=300)
    x0 = [_x(q, 0) for q in range(W)]
    x1 = [_x(q, 1) for q in range(W)]
    for r in range(W):
        got = res[r]["correct"]
        # after construction sync w = 1, extra = 2 and count = 1 on every rank; extra used on rank 1 only
        assert torch.equal(got["accumulate"]["w"], (x0[0] + x0[1] + x1[0] + x1[1]) / 2)
        assert torch.equal(got["accumulate"]["extra"], (x0[1] + x1[1]) / 2)
        assert torch.equal(got["forward-in-no-sync"]["w"], x0[r])  # not reduced
        assert torch.equal(got["used-in-no-sync-only"]["extra"], (x0[0] + x0[1]) / 2)
        assert torch.equal(got["dict-output"]["w"], (x0[0] + x0[1]) / 2)
        kw_extra = got["kwargs-in-no-sync"]["extra"]  # rank=1 reached the model inside no_sync
        assert kw_extra is None if r == 0 else torch.equal(kw_extra, x0[1])
        assert got["autocast"] == torch.bfloat16
        assert torch.equal(got["buffers-second-forward"], (x0[0] * 1).sum().reshape(()))  # rank 0's count, 1
        x64 = [_x(q, 0, torch.float64, third=True) for q in range(W)]
        assert torch.equal(got["fp64"]["w"], (x64[0] + x64[1]) / 2)
    # join: every rank keeps the model of rank 1, the last to run out of data
    assert _same(res[0]["correct"]["join"], res[1]["correct"]["join"])


def test_mutants_differ_from_correct():
    """Every mutant in one world (none hangs on these probes: a raise is recorded per probe)."""
    names = ["correct", *sorted(zoo.MUTANTS)]
    res = run_world(_rank_main, W, names, None, timeout=300)
    same = [n for n in names[1:] if all(_same(res[r][n], res[r]["correct"]) for r in range(W))]
    assert not same, f"not shown wrong: {same}"
