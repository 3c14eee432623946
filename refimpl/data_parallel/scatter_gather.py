"""scatter / gather: split a batch across devices and put the outputs back together.

Both are autograd functions: `Scatter`'s backward gathers the chunk gradients back onto the
input's device, `Gather`'s backward scatters the output gradient back to the replicas.

[Note: chunking]
A batch of `L` rows over `n` devices is split into `k = min(n, L)` *balanced* chunks:
sizes differ by at most one and the larger chunks come first, exactly the sizes of
`torch.tensor_split(x, k, dim)` - e.g. 5 rows over 4 devices -> 2, 1, 1, 1; 3 rows over
4 devices -> 1, 1, 1 (three replicas). Empty chunks are never made, so no replica ever
runs on an empty batch (an empty batch, L = 0, gives one empty chunk). This differs from
`torch.nn.DataParallel`, which uses `torch.chunk` (5 over 4 -> 2, 2, 1: three replicas),
and it changes no gradient: the gradient of a sum over rows does not depend on the split.
Pass `chunk_sizes` to choose the split yourself.

Every tensor found in the (nested) inputs is split along `dim`; all of them must yield the
same number of chunks, otherwise rows would be dropped silently (torch's `zip` would):
that raises. Non-tensors - and empty containers - are passed by reference to every chunk.
If the inputs hold no tensor at all there is one chunk (nothing to split means no reason
to run more than one replica). 0-dim tensors cannot be split and raise; pass a number.

[Note: gathering]
Tensors are concatenated along `dim` on `output_device`. If every replica returned a 0-dim
tensor (a per-replica loss) the result is a vector with one entry per replica, as in
torch. `None` gathers to `None`. Other non-tensor leaves gather to the value if all
replicas agree (`==`), else to the list of per-replica values. Containers (tuple, list,
dict, namedtuple) keep their type; structures that differ between replicas raise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..nested import is_namedtuple as _is_namedtuple
from ..nested import iter_tensors as _tensors
from ..nested import move_to
from ..nested import rebuild_mapping as _rebuild_mapping
from .devices import DeviceLike, normalize_device, normalize_devices

__all__ = ["Gather", "Scatter", "balanced_chunk_sizes", "gather", "move_to", "scatter", "scatter_kwargs"]


def balanced_chunk_sizes(length: int, n: int) -> list[int]:
    """Sizes of `torch.tensor_split(range(length), min(n, length))`; `[0]` for an empty batch."""
    if n < 1:
        raise ValueError(f"need at least one chunk, got n={n}")
    if length == 0:
        return [0]
    k = min(n, length)
    base, extra = divmod(length, k)
    return [base + 1] * extra + [base] * (k - extra)


class Scatter(torch.autograd.Function):
    """`apply(devices, sizes, dim, x)` -> chunk `j` of `x` along `dim` on `devices[j]`."""

    @staticmethod
    def forward(ctx, devices: Sequence[torch.device], sizes: Sequence[int], dim: int, x: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.dim, ctx.sizes, ctx.source = dim, list(sizes), x.device
        chunks = torch.split(x, list(sizes), dim)
        # Same device: a copy, not a view, so a module may modify its input in place as it
        # could outside data_parallel (autograd forbids in-place on a Function's view outputs).
        return tuple(c.clone() if c.device == d else c.to(d) for c, d in zip(chunks, devices, strict=True))

    @staticmethod
    def backward(ctx, *grads):
        if all(g is None for g in grads):
            return None, None, None, None
        parts = []
        for g, size in zip(grads, ctx.sizes, strict=True):
            if g is None:  # this replica's chunk did not influence the loss
                ref = next(x for x in grads if x is not None)
                shape = list(ref.shape)
                shape[ctx.dim] = size
                parts.append(ref.new_zeros(shape, device=ctx.source))
            else:
                parts.append(g.to(ctx.source))
        return None, None, None, torch.cat(parts, ctx.dim)


class Gather(torch.autograd.Function):
    """`apply(device, dim, *xs)` -> `torch.cat(xs, dim)` on `device` (0-dim xs: stacked)."""

    @staticmethod
    def forward(ctx, device: torch.device, dim: int, *xs: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.scalars = all(x.dim() == 0 for x in xs)
        if ctx.scalars:
            xs = tuple(x.reshape(1) for x in xs)
            dim = 0
        ctx.dim = dim
        ctx.devices = [x.device for x in xs]
        ctx.sizes = [x.size(dim) for x in xs]
        return torch.cat([x.to(device) for x in xs], dim)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None, None) + (None,) * len(ctx.sizes)
        parts = torch.split(grad, ctx.sizes, ctx.dim)
        out = tuple(
            (p.reshape(()) if ctx.scalars else p).to(d) for p, d in zip(parts, ctx.devices, strict=True)
        )
        return (None, None, *out)


def _plan(obj: Any, n: int, dim: int, chunk_sizes: Sequence[int] | None) -> dict[int, list[int]]:
    """Chunk sizes per tensor (by id); checks that every tensor yields the same chunk count."""
    plans: dict[int, list[int]] = {}
    first: tuple[str, list[int]] | None = None
    for path, t in _tensors(obj):
        if t.dim() == 0:
            raise ValueError(
                f"cannot scatter the 0-dim tensor {path} along dim {dim}; pass a Python "
                "number, or give it a batch dimension"
            )
        d = dim if dim >= 0 else dim + t.dim()
        if not 0 <= d < t.dim():
            raise ValueError(f"cannot scatter {path} of shape {tuple(t.shape)} along dim {dim}")
        length = t.size(d)
        if chunk_sizes is not None:
            sizes = list(chunk_sizes)
            if sum(sizes) != length or len(sizes) > n or any(s < 0 for s in sizes):
                raise ValueError(
                    f"chunk_sizes {sizes} do not fit {path}: its size along dim {dim} is "
                    f"{length} and there are {n} devices"
                )
        else:
            sizes = balanced_chunk_sizes(length, n)
        if first is None:
            first = (path, sizes)
        elif len(sizes) != len(first[1]):
            raise ValueError(
                f"inputs split into different numbers of chunks: {first[0]} -> "
                f"{first[1]} but {path} -> {sizes} (sizes {sum(first[1])} and {length} along "
                f"dim {dim} over {n} devices); scattering them would drop rows"
            )
        plans[id(t)] = sizes
    return plans


def _scatter_map(obj: Any, devices, dim: int, k: int, plans: dict[int, list[int]]) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        d = dim if dim >= 0 else dim + obj.dim()
        return list(Scatter.apply(devices[:k], plans[id(obj)], d, obj))
    if _is_namedtuple(obj):
        parts = [_scatter_map(v, devices, dim, k, plans) for v in obj]
        return [type(obj)(*(p[j] for p in parts)) for j in range(k)]
    if isinstance(obj, (tuple, list)) and len(obj) > 0:
        parts = [_scatter_map(v, devices, dim, k, plans) for v in obj]
        return [type(obj)(p[j] for p in parts) for j in range(k)]
    if isinstance(obj, Mapping) and len(obj) > 0:
        parts = {key: _scatter_map(v, devices, dim, k, plans) for key, v in obj.items()}
        return [_rebuild_mapping(obj, ((key, p[j]) for key, p in parts.items())) for j in range(k)]
    return [obj] * k


def scatter(
    inputs: Any,
    devices: Sequence[DeviceLike],
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
) -> list[Any]:
    """Split `inputs` (a tensor or a nested tuple/list/dict of them) into per-device chunks.

    Returns a list with one entry per chunk (see [Note: chunking]); entry `j` has the
    structure of `inputs` and lives on `devices[j]`.
    """
    devices = normalize_devices(devices)
    plans = _plan(inputs, len(devices), dim, chunk_sizes)
    k = len(next(iter(plans.values()))) if plans else 1
    return _scatter_map(inputs, devices, dim, k, plans)


def scatter_kwargs(
    inputs: tuple,
    kwargs: Mapping[str, Any] | None,
    devices: Sequence[DeviceLike],
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
) -> tuple[list[tuple], list[dict]]:
    """Scatter positional and keyword arguments together (one chunk count for both)."""
    if not isinstance(inputs, tuple):
        raise TypeError(f"inputs must be a tuple of positional arguments, got {type(inputs).__name__}")
    pairs = scatter((inputs, dict(kwargs or {})), devices, dim, chunk_sizes)
    return [tuple(a) for a, _ in pairs], [dict(kw) for _, kw in pairs]


def _gather_map(outputs: list[Any], device: torch.device, dim: int, path: str) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise TypeError(f"output {path}: replica 0 returned a tensor, others did not")
        return Gather.apply(device, dim, *outputs)
    if first is None:
        if any(o is not None for o in outputs):
            raise TypeError(f"output {path}: replica 0 returned None, others did not")
        return None
    if isinstance(first, Mapping):
        keys = list(first.keys())
        for j, o in enumerate(outputs):
            if not isinstance(o, Mapping) or set(o.keys()) != set(keys):
                raise ValueError(f"output {path}: replica {j} returned keys that differ from replica 0's {keys}")
        return _rebuild_mapping(
            first, ((key, _gather_map([o[key] for o in outputs], device, dim, f"{path}[{key!r}]")) for key in keys)
        )
    if isinstance(first, (tuple, list)):
        for j, o in enumerate(outputs):
            if type(o) is not type(first) or len(o) != len(first):
                raise ValueError(f"output {path}: replica {j} returned a {type(o).__name__} of a different length than replica 0")
        parts = [_gather_map([o[i] for o in outputs], device, dim, f"{path}[{i}]") for i in range(len(first))]
        return type(first)(*parts) if _is_namedtuple(first) else type(first)(parts)
    try:
        same = all(bool(o == first) for o in outputs[1:])
    except Exception:  # e.g. arrays, whose == is elementwise
        same = False
    return first if same else list(outputs)


def gather(outputs: Sequence[Any], output_device: DeviceLike, dim: int = 0) -> Any:
    """Combine per-replica outputs on `output_device` (see [Note: gathering])."""
    if len(outputs) == 0:
        raise ValueError("gather needs at least one output")
    return _gather_map(list(outputs), normalize_device(output_device), dim, "output")
