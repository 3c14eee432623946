"""Each independent sharded mutant is genuinely buggy: shown outside the suite in a 2-rank gloo
world, by probes compared with the unmutated engine (itself checked against sums by hand)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters.protocol import OptimizerSpec
from conformance.mutants.independent import sharded as zoo
from tests.conformance.independent_results import same as _same
from tests.refimpl._refimpl_world import run_world

pytestmark = pytest.mark.slow

W = 2


class Net(nn.Module):
    """out = w * x (+ extra * x on rank 1 only) ; `scale` keyword multiplies; a counter buffer."""

    def __init__(self, rank, dtype=torch.float32):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), float(rank + 1), dtype=dtype))
        self.extra = nn.Parameter(torch.full((3,), float(rank + 2), dtype=dtype))
        self.register_buffer("count", torch.tensor(float(rank + 1), dtype=dtype))
        self.rank = rank

    def forward(self, x, scale=1.0, idle=False):
        if idle:
            return (x * 0).sum()
        out = (self.w * x).sum() * scale * self.count
        if self.rank == 1:
            out = out + (self.extra * x[:3]).sum()
        return out


def _x(rank, step, dtype=torch.float32):
    return (torch.arange(4, dtype=dtype) + rank + 2 * step).requires_grad_()


def _wrap(adapter, model, broadcast_buffers=True, optimizer="none"):
    ctx = SimpleNamespace(group=dist.group.WORLD, device=torch.device("cpu"))
    options = SimpleNamespace(broadcast_buffers=broadcast_buffers, bucket_cap_mb=None)
    return adapter.wrap(model, ctx, options, OptimizerSpec(optimizer))


def _grads(wrapped):
    return {k: None if v is None else v.clone() for k, v in wrapped.full_gradients().items()}


def _probes(adapter, rank, only=None):
    out = {}

    def probe(name):
        return only is None or name in only

    if probe("accumulate"):  # two synced backwards, no zero_grad
        w = _wrap(adapter, Net(rank))
        for step in range(2):
            w(_x(rank, step)).backward()
        out["accumulate"] = _grads(w)
    if probe("forward-in-no-sync"):
        w = _wrap(adapter, Net(rank))
        with w.no_sync():
            loss = w(_x(rank, 0))
        loss.backward()
        out["forward-in-no-sync"] = _grads(w)
    if probe("rank1-only"):
        w = _wrap(adapter, Net(rank))
        w(_x(rank, 0)).backward()
        out["rank1-only"] = _grads(w)
    if probe("fp64-rank1-only"):
        w = _wrap(adapter, Net(rank, torch.float64))
        w(_x(rank, 0, torch.float64)).backward()
        out["fp64-rank1-only"] = _grads(w)
    if probe("buffers-at-init"):
        w = _wrap(adapter, Net(rank), broadcast_buffers=False)
        out["buffers-at-init"] = w.full_buffers()
    if probe("kwargs"):
        w = _wrap(adapter, Net(rank))
        out["kwargs"] = w(_x(rank, 0), scale=3.0).detach()
    if probe("buffers-second-forward"):
        w = _wrap(adapter, Net(rank))
        w(_x(rank, 0))
        with torch.no_grad():
            w.module.count.add_(rank)  # rank-local change between forwards (as BatchNorm's stats)
        out["buffers-second-forward"] = w(_x(0, 0)).detach()
    if probe("idle-in-no-sync"):
        w = _wrap(adapter, Net(rank))
        with w.no_sync():
            w(_x(rank, 0), idle=rank == 1).backward()
        w(_x(rank, 1)).backward()
        out["idle-in-no-sync"] = _grads(w)
    if probe("zero-grad-after-no-sync"):
        w = _wrap(adapter, Net(rank), optimizer="sgd")
        with w.no_sync():
            w(_x(rank, 0)).backward()
        w.optimizer.zero_grad()
        w(_x(rank, 1)).backward()
        out["zero-grad-after-no-sync"] = _grads(w)
    if probe("step"):
        w = _wrap(adapter, Net(rank), optimizer="sgd")
        w(_x(rank, 0)).backward()
        w.optimizer.step()
        out["step"] = w.full_parameters()
    return out


def _rank_main(rank, world_size, names, only):
    return {n: _probes(zoo.correct() if n == "correct" else zoo.MUTANTS[n](), rank, only) for n in names}


ABORTING = {n for n, cls in zoo.MUTANTS.items() if cls.may_abort}


def test_correct_by_hand():
    res = run_world(_rank_main, W, ["correct"], None, timeout=300)
    for r in range(W):
        got = res[r]["correct"]
        x0 = [_x(q, 0).detach() for q in range(W)]
        x1 = [_x(q, 1).detach() for q in range(W)]
        # rank 0's w is 1 and count 1 after construction sync; extra is used on rank 1 only
        assert torch.equal(got["rank1-only"]["w"], (x0[0] + x0[1]) / 2)
        assert torch.equal(got["rank1-only"]["extra"], x0[1][:3] / 2)
        assert torch.equal(got["accumulate"]["w"], (x0[0] + x0[1] + x1[0] + x1[1]) / 2)
        assert torch.equal(got["zero-grad-after-no-sync"]["w"], (x1[0] + x1[1]) / 2)
        assert torch.equal(got["buffers-at-init"]["count"], torch.tensor(1.0))


def test_non_aborting_mutants_differ_from_correct():
    names = ["correct", *sorted(set(zoo.MUTANTS) - ABORTING)]
    res = run_world(_rank_main, W, names, None, timeout=300)
    same = [n for n in names[1:] if all(_same(res[r][n], res[r]["correct"]) for r in range(W))]
    assert not same, f"not shown wrong: {same}"


PROBE_OF = {"sync-read-at-backward": "forward-in-no-sync", "unused-zeros-default-dtype": "fp64-rank1-only",
            "idle-check-ignores-no-sync": "idle-in-no-sync"}


@pytest.mark.parametrize("name", sorted(ABORTING))
def test_aborting_mutant_is_wrong_or_stops(name):
    probe = {PROBE_OF[name]}
    good = run_world(_rank_main, W, ["correct"], probe, timeout=300)
    try:
        bad = run_world(_rank_main, W, [name], probe, timeout=5)
    except BaseException:  # noqa: BLE001 - a raise, crash or hang is the bug showing
        return
    assert not all(_same(bad[r][name], good[r]["correct"]) for r in range(W))
