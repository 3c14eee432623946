"""Each sharded interaction mutant (issue 38) is genuinely buggy: in a 2-rank gloo world, outside
the suite, on an input where its two things meet, it fires and gives other values than the
correct engine (refimpl ZeRO-3, or ZeRO-2 for the ZeRO-2 mutant); the correct engines give the
values worked out by hand and never fire."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conformance.mutants.independent import interactions_sharded as zoo
from conformance.spec import WrapOptions
from tests.conformance.independent_results import assert_fires_and_differs, run_probes
from tests.refimpl._refimpl_world import run_world

pytestmark = pytest.mark.slow

W = 2


class Lin(nn.Module):
    """loss = sum(lin(x)): weight.grad rows are the summed inputs, bias.grad the batch size.
    Continuous, rank-dependent initial values (construction takes rank 0's)."""

    def __init__(self, rank, dtype=torch.float32):
        super().__init__()
        self.lin = nn.Linear(4, 3, dtype=dtype)  # weight (3, 4): dim 1 even; bias 3: W does not divide
        with torch.no_grad():
            self.lin.weight.copy_(torch.arange(12.0).view(3, 4) / 3 + rank)
            self.lin.bias.copy_(torch.arange(3.0) / 7 + rank)

    def forward(self, x, rank=0, micro=0):
        return self.lin(x).float().sum()


_SCRATCH: dict = {}  # a rank process's scratch, as the pool's RankContext keeps it (the HSDP mesh)


def _ctx(rank):
    return SimpleNamespace(rank=rank, world_size=W, group=dist.group.WORLD, device=torch.device("cpu"),
                           backend="gloo", scratch=_SCRATCH)


def _wrap(adapter, rank, dtype=torch.float32, **options):
    return adapter.wrap(Lin(rank, dtype), _ctx(rank), WrapOptions(**options))


def _x(rank, dtype=torch.float32):
    return (torch.tensor([[1.0, 2.0, 3.0, 4.0]]) / 3 * (rank + 1)).to(dtype)


def _backward(adapter, rank, clip=None, x=None, dtype=torch.float32, **options):
    w = _wrap(adapter, rank, dtype, **options)
    w(_x(rank, dtype) if x is None else x).backward()
    if clip is not None:
        w.clip_grad_norm_(clip)
    return {"grads": w.full_gradients(), "fired": w.sdp.mutation_fired}


def _round_trip(adapter, rank, **options):
    """A full state dict saved after one step and loaded into a fresh engine."""
    w = _wrap(adapter, rank, **options)
    state = w.checkpoint("full", None)
    fresh = _wrap(adapter, rank + 1, **options)  # other values, all replaced by the load
    fresh.load_checkpoint("full", state, None)
    return {"params": fresh.full_parameters(), "fired": w.sdp.mutation_fired + fresh.sdp.mutation_fired}


PROBES = {
    "hsdp-clip-counts-replicas": lambda a, r: _backward(a, r, clip=0.5, hsdp_replicas=2),
    "clip-norm-in-param-dtype": lambda a, r: _backward(a, r, clip=0.5, param_dtype="bfloat16",  # squares need > 8 bits
                                                       x=torch.tensor([[1.1, 2.3, 3.7, 4.9]]) * (r + 1)),
    "hsdp-mp-divides-by-shard-group": lambda a, r: _backward(a, r, hsdp_replicas=2, param_dtype="bfloat16"),
    "placement-dim1-cast-path": lambda a, r: _backward(a, r, shard_placement="dim1-if-even", param_dtype="bfloat16"),
    "checkpoint-load-through-compute-dtype": lambda a, r: _round_trip(a, r, param_dtype="bfloat16"),
    "full-load-uneven-offset": lambda a, r: _round_trip(a, r),
    "zero2-half-sum-then-divide": lambda a, r: _backward(a, r, x=torch.tensor([[4e4, 1.0, 2.0, 3.0]], dtype=torch.float16),
                                                       dtype=torch.float16),
}


def _correct_for(name):
    return zoo.correct_zero2() if name.startswith("zero2-") else zoo.correct()


def _rank_main(rank, world_size):
    return run_probes(PROBES, _correct_for, zoo.MUTANTS, rank)


@pytest.fixture(scope="module")
def world():
    return run_world(_rank_main, W, timeout=300)


def test_every_mutant_has_a_probe():
    assert set(PROBES) == set(zoo.MUTANTS)


def _mean_weight_grad():
    return sum(_x(q).sum(0) for q in range(W)).expand(3, 4) / W


def test_correct_by_hand(world):
    for r in range(W):
        got = world[r]["correct"]
        assert all(v["fired"] == 0 for v in got.values())
        g = got["hsdp-clip-counts-replicas"]["grads"]  # clipped to the global norm 0.5
        norm = torch.cat([g["lin.weight"].reshape(-1), g["lin.bias"]]).norm()
        assert math.isclose(norm.item(), 0.5, rel_tol=1e-5)
        assert torch.allclose(got["hsdp-mp-divides-by-shard-group"]["grads"]["lin.weight"], _mean_weight_grad(),
                              rtol=2**-7)  # the mean over S*R = 2 ranks (bf16 compute)
        placed = got["placement-dim1-cast-path"]["grads"]["lin.weight"]
        assert torch.allclose(placed, _mean_weight_grad(), rtol=2**-7)
        loaded = got["full-load-uneven-offset"]["params"]
        assert torch.equal(loaded["lin.bias"], torch.arange(3.0) / 7)  # rank 0's, saved and loaded
        saved_w = torch.arange(12.0).view(3, 4) / 3
        assert torch.equal(got["checkpoint-load-through-compute-dtype"]["params"]["lin.weight"], saved_w)
        assert got["zero2-half-sum-then-divide"]["grads"]["lin.weight"][0, 0] == 4e4  # 2e4 + 2e4


@pytest.mark.parametrize("name", sorted(PROBES))
def test_mutant_fires_and_differs(world, name):
    assert_fires_and_differs(world, name)
