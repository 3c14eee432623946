"""Each DDP interaction mutant (issue 38) is genuinely buggy: in a 2-rank gloo world, outside the
suite, on an input where its two things meet, it fires and gives other values than the correct
engine; the correct engine gives the values worked out by hand and never fires."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conformance.mutants.independent import interactions_ddp as zoo
from conformance.spec import WrapOptions
from tests.conformance.independent_results import assert_fires_and_differs, run_probes
from tests.refimpl._refimpl_world import run_world

pytestmark = pytest.mark.slow

W = 2


class Net(nn.Module):
    """loss = (w . x) * count (+ extra . x and an embedding where used); rank-dependent init."""

    def __init__(self, rank, dtype=torch.float32, sparse=False):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), float(rank + 1), dtype=dtype))
        self.extra = nn.Parameter(torch.full((4,), float(rank + 2), dtype=dtype))
        self.register_buffer("count", torch.tensor(float(rank + 1), dtype=dtype))
        self.emb = nn.Embedding(6, 4, sparse=True) if sparse else None

    def forward(self, x, *, use_extra=False, bump=0.0):
        loss = (self.w * x).sum() * self.count.clone()  # a bump after it must not touch the graph
        if use_extra:
            loss = loss + (self.extra * x).sum()
            if self.emb is not None:
                loss = loss + self.emb(torch.tensor([1, 2])).sum()
        if bump:
            with torch.no_grad():
                self.count.add_(bump)
        return loss


def _wrap(adapter, model, **options):
    ctx = SimpleNamespace(group=dist.group.WORLD, device=torch.device("cpu"))
    return adapter.wrap(model, ctx, WrapOptions(**{"find_unused_parameters": True, **options}))


def _run(adapter, rank, x, dtype=torch.float32, **options):
    w = _wrap(adapter, Net(rank, dtype), **options)
    w(x.to(dtype)).backward()
    return {"grads": w.full_gradients(), "fired": w.ddp.mutation_fired}


def _fp16_large(a, rank):  # grad 7e4: past fp16's range before the hook divides
    return _run(a, rank, torch.tensor([7e4, 1.0, 2.0, 3.0]), comm_hook="fp16")


def _fp16_tiny(a, rank):  # grad / 2 below fp16's smallest normal (2**-14)
    return _run(a, rank, torch.tensor([2.0**-20, 3 * 2.0**-22, 1e-6, 1.0]), comm_hook="fp16")


def _bf16_params_fp16_hook(a, rank):  # a bf16 bucket through the fp16 hook, a value fp16 cannot hold
    return _run(a, rank, torch.tensor([1e5, 1.0, 2.0, 3.0]), dtype=torch.bfloat16, comm_hook="fp16")


def _reduce_fp16_large(a, rank):  # 4e4 per rank: 2e4 + 2e4 fits fp16, 4e4 + 4e4 does not
    return _run(a, rank, torch.tensor([4e4, 1.0, 2.0, 3.0]), reduce_dtype="float16")


def _third(rank, micro):
    """Micro-batch 0 rounds down to bf16 alone, yet its sum with micro-batch 1 rounds up (2**-7 is
    bf16's spacing at 1): rounding the first alone loses what the sum keeps."""
    low = torch.tensor([0.4, 0.3, 0.45, 0.1]) * 2.0**-7 * (rank + 1)
    return 1 + low if micro == 0 else low


def _reduce_bf16_no_sync(a, rank):  # continuous values accumulated in no_sync() under reduce_dtype
    w = _wrap(a, Net(rank), reduce_dtype="bfloat16")
    with w.no_sync():
        w(_third(rank, 0)).backward()
    w(_third(rank, 1)).backward()
    return {"grads": w.full_gradients(), "fired": w.ddp.mutation_fired}


def _buffers_off(a, rank):  # broadcast_buffers=False: each rank keeps its own count (rank + 1)
    return _run(a, rank, torch.arange(4.0) + 1, broadcast_buffers=False)


def _buffers_after_no_sync(a, rank):  # a count bumped inside no_sync(), read by the synced forward
    w = _wrap(a, Net(rank))
    x = torch.arange(4.0) + 1
    with w.no_sync():
        w(x, bump=rank + 1.0).backward()
    w(x).backward()
    return {"grads": w.full_gradients(), "buffers": w.full_buffers(), "fired": w.ddp.mutation_fired}


def _static_unused(a, rank):  # static_graph; `extra` used on rank 1 only
    w = _wrap(a, Net(rank), static_graph=True)
    x = torch.arange(4.0) + 1
    w(x, use_extra=rank == 1).backward()
    return {"grads": w.full_gradients(), "fired": w.ddp.mutation_fired}


def _xj(rank, step):
    return torch.arange(4.0) + 10 * rank + step


def _join(a, rank):  # rank 0 has one batch, rank 1 three; the divisor is the active ranks
    w = _wrap(a, Net(rank))
    grads = {}
    with w.ddp.join(divide_by_initial_world_size=False):
        for step in range(1 if rank == 0 else 3):
            w(_xj(rank, step)).backward()
            grads[step] = w.module.w.grad.clone()
            w.module.zero_grad(set_to_none=True)
    return {"grads": grads, "fired": w.ddp.mutation_fired}


def _sparse_unused(a, rank):  # a sparse embedding used by rank 1 only
    w = _wrap(a, Net(rank, sparse=True))
    w(torch.arange(4.0) + 1, use_extra=rank == 1).backward()
    return {"grads": w.full_gradients(), "fired": w.ddp.mutation_fired}


def _optimizer_before_wrap(a, rank):  # the optimizer is built over module.parameters() first
    model = Net(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    w = _wrap(a, model)
    w(torch.arange(4.0) + 1).backward()
    opt.step()
    return {"params": w.full_parameters(), "fired": w.ddp.mutation_fired}


PROBES = {
    "fp16-hook-saturates": _fp16_large,
    "fp16-hook-flushes-subnormals": _fp16_tiny,
    "half-params-skip-compression": _bf16_params_fp16_hook,
    "reduce-dtype-sums-before-divide": _reduce_fp16_large,
    "reduce-dtype-accumulates-low": _reduce_bf16_no_sync,
    "broadcast-buffers-off-ignored": _buffers_off,
    "buffers-broadcast-after-no-sync": _buffers_after_no_sync,
    "static-graph-local-used-map": _static_unused,
    "join-divisor-cached": _join,
    "sparse-unused-keeps-none": _sparse_unused,
    "params-replaced-at-wrap": _optimizer_before_wrap,
}


def _rank_main(rank, world_size):
    return run_probes(PROBES, lambda name: zoo.correct(), zoo.MUTANTS, rank)


@pytest.fixture(scope="module")
def world():
    return run_world(_rank_main, W, timeout=300)


def test_every_mutant_has_a_probe():
    assert set(PROBES) == set(zoo.MUTANTS)


def test_correct_by_hand(world):
    x = torch.arange(4.0) + 1
    for r in range(W):
        got = world[r]["correct"]
        assert all(v["fired"] == 0 for v in got.values())
        assert math.isinf(got["fp16-hook-saturates"]["grads"]["w"][0])  # torch's cast overflows
        tiny = got["fp16-hook-flushes-subnormals"]["grads"]["w"]
        assert tiny[0] == 2.0**-20 and tiny[1] != 0  # fp16 subnormals kept
        assert math.isinf(got["half-params-skip-compression"]["grads"]["w"][0])
        assert got["reduce-dtype-sums-before-divide"]["grads"]["w"][0] == 4e4
        acc = [_third(q, 0) + _third(q, 1) for q in range(W)]
        want = sum((a.to(torch.bfloat16) / 2 for a in acc[1:]), acc[0].to(torch.bfloat16) / 2).float()
        assert torch.equal(got["reduce-dtype-accumulates-low"]["grads"]["w"], want)
        assert torch.equal(got["broadcast-buffers-off-ignored"]["grads"]["w"], (x * 1 + x * 2) / 2)
        after = got["buffers-broadcast-after-no-sync"]
        assert torch.equal(after["grads"]["w"], (3 * x + 4 * x) / 2)  # counts 2 and 3, not broadcast
        assert after["buffers"]["count"] == 2.0 + r
        assert torch.equal(got["static-graph-local-used-map"]["grads"]["extra"], x / 2)
        assert torch.equal(got["sparse-unused-keeps-none"]["grads"]["emb.weight"].abs().sum(), torch.tensor(4.0))
        assert torch.equal(got["params-replaced-at-wrap"]["params"]["w"], 1 - 0.5 * x)
    join1 = world[1]["correct"]["join-divisor-cached"]["grads"]
    assert torch.equal(join1[0], (_xj(0, 0) + _xj(1, 0)) / 2)
    assert torch.equal(join1[1], _xj(1, 1)) and torch.equal(join1[2], _xj(1, 2))  # one active rank


@pytest.mark.parametrize("name", sorted(PROBES))
def test_mutant_fires_and_differs(world, name):
    assert_fires_and_differs(world, name)
