"""Clipping sharded gradients by their global norm, for both sharded engines.

Each rank holds a disjoint shard of every gradient (padding is zero), so the p-th powers of
the shards' norms add up to the full gradient's: one all-reduce of a scalar over the group
that holds the shards gives the global norm on every rank, and every rank scales its shard by
the same coefficient. Clipping each shard by its own norm instead is pytorch/pytorch#170862.
Under HSDP `group` is the shard group: the replicas hold equal shards after their all-reduce.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor


@torch.no_grad()
def clip_shards_(grads: list[Tensor], max_norm: float, norm_type: float, group, device: torch.device) -> Tensor:
    """Scale `grads` (this rank's gradient shards) in place so the global norm is at most
    `max_norm`, as `torch.nn.utils.clip_grad_norm_` would on the full gradients; returns the
    global norm, in fp32 or the gradients' wider dtype (fp64 gradients: an fp32 norm would
    round their clip coefficient to fp32, where torch's stays fp64)."""
    dtype = torch.float32
    for g in grads:
        dtype = torch.promote_types(dtype, g.dtype)
    if norm_type == math.inf:
        total = (torch.stack([g.abs().max().to(dtype) for g in grads]).max() if grads
                 else torch.zeros((), dtype=dtype, device=device))
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = sum((g.to(dtype).abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=dtype, device=device))
        dist.all_reduce(total, group=group)
        total = total.pow(1.0 / norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
