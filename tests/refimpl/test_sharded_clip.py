"""refimpl.sharded.clip: the shards' global norm equals the full gradient's, and every rank's
shard is scaled as torch's clip_grad_norm_ scales the full gradient (2-rank gloo world)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tests.refimpl._refimpl_world import run_world


def _full_grads():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(6, 5, generator=g), torch.randn(7, generator=g)]


def _clip_on_rank(rank, world_size, norm_type):
    from refimpl.sharded.clip import clip_shards_

    full = _full_grads()
    shards = [f.reshape(-1).tensor_split(world_size)[rank].clone() for f in full]  # disjoint, uneven
    local_only = [s.clone() for s in shards]
    total = clip_shards_(shards, 0.5, norm_type, dist.group.WORLD, torch.device("cpu"))
    # The bug the module avoids (pytorch/pytorch#170862): each rank's own norm.
    local_norm = torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(s) for s in local_only], 0.5, norm_type)
    return {"total": total.item(), "shards": shards, "local_norm": local_norm.item()}


def _run(norm_type):
    return run_world(_clip_on_rank, 2, norm_type, timeout=120)


def test_global_norm_and_scaled_shards_equal_torch_on_the_full_gradient():
    for norm_type in (2.0, math.inf):
        params = [torch.nn.Parameter(torch.zeros_like(f)) for f in _full_grads()]
        for p, f in zip(params, _full_grads(), strict=True):
            p.grad = f.clone()
        expected_norm = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type).item()
        outs = _run(norm_type)
        for rank, out in enumerate(outs):
            assert math.isclose(out["total"], expected_norm, rel_tol=1e-6), (norm_type, out["total"], expected_norm)
            assert not math.isclose(out["local_norm"], expected_norm, rel_tol=1e-3)  # the local norm differs
            for p, shard in zip(params, out["shards"], strict=True):
                want = p.grad.reshape(-1).tensor_split(2)[rank]
                torch.testing.assert_close(shard, want, rtol=1e-6, atol=0)


def _fp64_norm_on_rank(rank, world_size):
    from refimpl.sharded.clip import clip_shards_

    full = [f.double() for f in _full_grads()]
    shards = [f.reshape(-1).tensor_split(world_size)[rank].clone() for f in full]
    total = clip_shards_(shards, 0.5, 2.0, dist.group.WORLD, torch.device("cpu"))
    return {"dtype": str(total.dtype), "total": total.item()}


def test_fp64_gradients_get_an_fp64_norm():
    # Found by the generated sharded standard (fp64 x clip far below the norm): an fp32 norm rounds
    # the coefficient of fp64 gradients to fp32, ~1e-8 relative, where torch's clip_grad_norm_ stays fp64.
    params = [torch.nn.Parameter(torch.zeros_like(f, dtype=torch.float64)) for f in _full_grads()]
    for p, f in zip(params, _full_grads(), strict=True):
        p.grad = f.double()
    expected = torch.nn.utils.clip_grad_norm_(params, 0.5).item()
    for out in run_world(_fp64_norm_on_rank, 2, timeout=120):
        assert out["dtype"] == "torch.float64"
        assert math.isclose(out["total"], expected, rel_tol=1e-14), (out["total"], expected)
