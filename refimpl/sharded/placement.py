"""Which dim refimpl's ZeRO-3 engine shards a parameter on (FSDP2's ``shard_placement_fn``).

Why: a flat chunk (refimpl's default, as FairScale and ZeRO do it) splits a weight row-major,
so a rank's chunk may start mid-row; FSDP2 lets a function choose ``Shard(d)`` per parameter,
e.g. ``Shard(1)`` to keep a weight's columns together for a kernel or a tensor-parallel plan.

How, without a second code path: a parameter placed on dim ``d`` is stored in *placement
order*, the flattening of ``p.movedim(d, 0)``; every read and write of the engine goes through
``to_layout`` / ``from_layout``, so gathering, reducing, resharding to a group and the state
dicts stay the flat-chunk code. With ``d = 0`` both are plain reshapes: the layout is the
flat chunk. With ``d > 0`` the size of dim ``d`` must be a multiple of the shard group's size
(FSDP2 refuses uneven sharding on a dim other than 0): then chunk ``r`` is exactly
``torch.chunk(p, W, dim=d)[r]``, with no padding, and ``shard_view`` shows it that way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["from_layout", "placement_dim", "shard_view", "to_layout"]


def placement_dim(fn: Callable | None, param: torch.nn.Parameter, world_size: int, name: str) -> int:
    """The dim ``fn(param)`` asks for (an int, or an object with ``.dim`` such as torch's ``Shard``;
    None: dim 0), refused with what to do where it cannot be honoured."""
    if fn is None:
        return 0
    asked = fn(param)
    dim = 0 if asked is None else getattr(asked, "dim", asked)
    if not isinstance(dim, int) or not -param.dim() <= dim < max(1, param.dim()):
        raise ValueError(f"shard_placement_fn asked for dim {asked!r} of {name!r} {tuple(param.shape)}: "
                         "return a dim of the parameter (an int or Shard(dim)) or None for dim 0")
    dim %= max(1, param.dim())
    if dim and param.shape[dim] % world_size:
        raise ValueError(f"shard_placement_fn asked for dim {dim} of {name!r} {tuple(param.shape)}, which "
                         f"{world_size} ranks do not divide: return dim 0 (uneven sharding is flat) for it")
    return dim


def to_layout(t: Tensor, dim: int) -> Tensor:
    """``t`` flattened in placement order (a view for dim 0)."""
    return t.reshape(-1) if dim == 0 else t.movedim(dim, 0).reshape(-1)


def from_layout(flat: Tensor, shape: torch.Size, dim: int) -> Tensor:
    """The tensor of ``shape`` whose placement-order flattening is ``flat``."""
    if dim == 0:
        return flat.view(shape)
    moved = (shape[dim], *shape[:dim], *shape[dim + 1:])
    return flat.reshape(moved).movedim(0, dim)


def shard_view(chunk: Tensor, shape: torch.Size, dim: int, world_size: int) -> Tensor:
    """A dim-``d`` chunk as ``torch.chunk(full, W, dim=d)[r]`` shows it (dim > 0 only)."""
    part = list(shape)
    part[dim] //= world_size
    return from_layout(chunk, torch.Size(part), dim)
