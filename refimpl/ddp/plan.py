"""Pure bucket planning: which parameters share a flat gradient buffer.

Nothing here communicates or touches gradients; the planner takes plain facts about
parameters (size, dtype, device, sparse or not) and returns plain, frozen data that the
reducer (``refimpl.ddp.reducer``) executes. Keeping planning pure is what lets the unit tests
check every rule without a process group, and lets a report print the plan.

The rules follow PyTorch's ``compute_bucket_assignment_by_size``:

* Parameters are visited in *reverse* registration order by default, because autograd
  produces gradients roughly from the last layer to the first; the earliest-ready gradients
  then share the first bucket, which can be launched while backward is still running.
* The first bucket of each (dtype, device) is capped at 1 MiB so the first all-reduce
  starts early; later buckets use the cap (25 MiB by default).  A bucket is closed as soon
  as its size reaches its limit (so a bucket may exceed the limit by one parameter).
* Only gradients of the same dtype on the same device can be flattened together, so each
  (dtype, device) pair fills its own stream of buckets.
* A parameter with sparse gradients (``nn.Embedding(sparse=True)``) cannot live in a flat
  dense buffer; it gets a bucket of its own.
* Buckets are numbered by when their first parameter is visited, which is the order in
  which they are expected to become ready, and the order every rank launches them in.

Usage::

    >>> infos = [ParamInfo.of(p) for p in model.parameters() if p.requires_grad]
    >>> plan = plan_buckets(infos, bucket_cap_bytes=25 * 2**20)
    >>> plan[0].param_indices      # the last layers' parameters, reverse order
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024

__all__ = [
    "DEFAULT_BUCKET_CAP_BYTES",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "BucketPlan",
    "ParamInfo",
    "compute_bucket_assignment_by_size",
    "plan_buckets",
]


@dataclass(frozen=True)
class ParamInfo:
    """What the planner needs to know about one parameter (no tensor is kept)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    sparse: bool = False

    @classmethod
    def of(cls, tensor: torch.Tensor, sparse: bool = False) -> ParamInfo:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device, sparse)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class BucketPlan:
    """One bucket: which parameters, where each sits in the flat buffer, what it holds.

    ``offsets[k]``/``lengths[k]`` locate parameter ``param_indices[k]`` in the flat buffer
    of ``numel`` elements; ``shapes[k]`` is its shape (the buffer view is reshaped to it).
    ``size_limit`` is the byte limit the bucket was filled against (for reports).
    """

    index: int
    param_indices: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: int
    dtype: torch.dtype
    device: torch.device
    sparse: bool
    size_limit: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _as_info(p: ParamInfo | torch.Tensor, sparse: bool) -> ParamInfo:
    if isinstance(p, ParamInfo):
        return p if not sparse or p.sparse else ParamInfo(p.shape, p.dtype, p.device, True)
    return ParamInfo.of(p, sparse)


def compute_bucket_assignment_by_size(
    params: Sequence[ParamInfo | torch.Tensor],
    size_limits: Sequence[int],
    expect_sparse_gradient: Sequence[bool] | None = None,
    order: Sequence[int] | None = None,
) -> list[tuple[list[int], int]]:
    """Group parameter indices into buckets; return ``[(indices, size_limit), ...]``.

    ``size_limits`` is the sequence of byte limits each (dtype, device) stream walks
    through; the last one repeats (``[1 MiB, 25 MiB]`` gives one 1 MiB bucket, then 25 MiB
    ones). ``order`` is the visiting order (default: reverse of ``params``); indices inside
    a bucket keep that order, and buckets are ordered by the position of their first index.
    """
    if not size_limits:
        raise ValueError("size_limits must name at least one byte limit")
    n = len(params)
    sparse_flags = list(expect_sparse_gradient) if expect_sparse_gradient is not None else [False] * n
    if len(sparse_flags) != n:
        raise ValueError(f"expect_sparse_gradient has {len(sparse_flags)} entries for {n} params")
    infos = [_as_info(p, s) for p, s in zip(params, sparse_flags, strict=True)]
    visit = list(range(n - 1, -1, -1)) if order is None else list(order)
    if sorted(visit) != list(range(n)):
        raise ValueError(f"order must be a permutation of range({n}), got {visit}")

    # Each finished bucket is (position of its first index, indices, limit).
    done: list[tuple[int, list[int], int]] = []
    # (dtype, device) -> [first position, indices, bytes, limit-iterator position]
    open_: dict[tuple[torch.dtype, torch.device], list] = {}
    for pos, idx in enumerate(visit):
        info = infos[idx]
        if info.sparse:
            done.append((pos, [idx], 0))
            continue
        key = (info.dtype, info.device)
        state = open_.get(key)
        if state is None or not state[1]:
            limit_pos = state[3] if state is not None else 0
            state = [pos, [], 0, limit_pos]
            open_[key] = state
        state[1].append(idx)
        state[2] += info.nbytes
        limit = size_limits[min(state[3], len(size_limits) - 1)]
        if state[2] >= limit:
            done.append((state[0], state[1], limit))
            open_[key] = [None, [], 0, state[3] + 1]
    for state in open_.values():
        if state[1]:
            done.append((state[0], state[1], size_limits[min(state[3], len(size_limits) - 1)]))
    done.sort(key=lambda b: b[0])
    return [(indices, limit) for _, indices, limit in done]


def plan_buckets(
    params: Sequence[ParamInfo | torch.Tensor],
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
    expect_sparse_gradient: Sequence[bool] | None = None,
    order: Sequence[int] | None = None,
) -> tuple[BucketPlan, ...]:
    """Plan the buckets (see module docstring) and lay out each flat buffer."""
    n = len(params)
    sparse_flags = list(expect_sparse_gradient) if expect_sparse_gradient is not None else [False] * n
    infos = [_as_info(p, s) for p, s in zip(params, sparse_flags, strict=True)]
    limits = [min(first_bucket_bytes, bucket_cap_bytes), bucket_cap_bytes]
    groups = compute_bucket_assignment_by_size(infos, limits, sparse_flags, order)
    plans = []
    for b, (indices, limit) in enumerate(groups):
        offsets, lengths, offset = [], [], 0
        for i in indices:
            offsets.append(offset)
            lengths.append(infos[i].numel)
            offset += infos[i].numel
        first = infos[indices[0]]
        plans.append(
            BucketPlan(
                index=b,
                param_indices=tuple(indices),
                offsets=tuple(offsets),
                lengths=tuple(lengths),
                shapes=tuple(infos[i].shape for i in indices),
                numel=offset,
                dtype=first.dtype,
                device=first.device,
                sparse=first.sparse,
                size_limit=limit,
            )
        )
    return tuple(plans)
