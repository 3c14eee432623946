"""Tensors inside nested Python structures (tuples, lists, namedtuples, mappings).

Forward inputs and outputs are arbitrary nests; DDP walks them to find the outputs' autograd
graph and to move inputs to a device, data_parallel scatters and gathers them. One walker
for all of them keeps the structure rules the same everywhere: namedtuples keep their type,
mappings keep theirs (OrderedDict, defaultdict, user mappings), non-tensors pass through.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields") and hasattr(obj, "_asdict")


def rebuild_mapping(like: Mapping, items) -> Mapping:
    """A mapping of `like`'s type holding `items`."""
    if type(like) is dict:
        return dict(items)
    out = copy.copy(like)  # keeps OrderedDict / defaultdict(factory) / user mappings' type
    out.clear()
    out.update(items)
    return out


def iter_tensors(obj: Any, path: str = "inputs") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (path, tensor) for every tensor in a nested structure (paths name them in errors)."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{path}[{i}]")
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{path}[{k!r}]")


def find_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested structure."""
    return (t for _, t in iter_tensors(obj))


def move_to(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """`obj` with every tensor moved to `device` (differentiably); structure and types kept."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if is_namedtuple(obj):
        return type(obj)(*(move_to(v, device, non_blocking) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(move_to(v, device, non_blocking) for v in obj)
    if isinstance(obj, Mapping):
        return rebuild_mapping(obj, ((k, move_to(v, device, non_blocking)) for k, v in obj.items()))
    return obj
