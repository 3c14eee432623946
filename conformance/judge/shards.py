"""Shard-by-shard checks of the `sharded` area (issue #26, item 2; contract clause S12).

The contract is judged on *gathered* tensors (`full_gradients()` / `full_parameters()`), but
a sharded engine computes with its shards: an engine whose gather rebuilds the right tensor
from the wrong place (a stale copy, another rank's chunk, padding that is not zero) passes
every gathered check while its optimizer steps something else. So where an adapter exposes
each rank's own shard (`Wrapped.local_shards()`, optional), every synced backward and every
step checks, on every rank, that the shard's parameter and gradient are *bitwise* the slice of
the gathered tensor that the engine's documented placement gives that rank; the gathered
tensor itself is judged against the oracle, so the shard then matches the oracle's slice.

Placements (what `local_shards()` declares per parameter):
* ``flat-chunk`` (refimpl ZeRO-2/ZeRO-3, FairScale, DeepSpeed): the flattened tensor,
  zero-padded to ``c * W`` with ``c = ceil(numel / W)``; rank r holds ``[r*c, (r+1)*c)``,
  padding included, and the padding must be zero.
* ``dim0-chunk`` (FSDP2's default ``Shard(0)``): ``torch.chunk(full, W, dim=0)[r]`` — rows
  ``ceil(d0 / W)`` at a time, ranks past the last chunk hold an empty tensor (no padding).
* ``dim1-chunk`` (FSDP2 with a ``shard_placement_fn`` returning ``Shard(1)``): the same along
  dim 1 (FSDP2 accepts it only where W divides that dim).

An adapter may declare a parameter shard's padding unspecified (``"param_padding": "unspecified"``
in its entry, with its reason in its docstring): only the real elements of the *parameter* shard
are compared then, and the report lists those parameters; gradient padding is always checked
(a norm over the shards counts it).

On a HSDP mesh (``WrapOptions.hsdp_replicas`` = R) the placement is over the shard group: rank
``r*S + s`` holds position ``s`` of ``S = W / R``, the same chunk as every replica's rank ``s``.

A scenario that asks for a placement (``WrapOptions.shard_placement``, issue #26) also checks
that each shard's declared placement is the one asked for: an engine that accepts a
``shard_placement_fn`` and shards on dim 0 anyway gathers the right tensors, so only this
check sees it. The rule is here, once, for the adapters that build the function and the check.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from conformance.judge.compare import (
    EXACT_ACROSS_RANKS,
    ConformanceError,
    compare_tensor,
    failure_message,
)

PLACEMENTS = ("flat-chunk", "dim0-chunk", "dim1-chunk")
SHARD_PLACEMENT_RULES = ("dim1-if-even",)


def placement_dim(rule: str, shape: tuple[int, ...], world_size: int) -> int:
    """The dim a parameter of `shape` is sharded on under `rule` ("dim1-if-even": dim 1 for a 2-D
    parameter whose dim 1 the world size divides, else FSDP2's default dim 0)."""
    if rule == "dim1-if-even":
        return 1 if len(shape) == 2 and shape[1] % world_size == 0 else 0
    raise ValueError(f"unknown shard placement rule {rule!r}; one of {SHARD_PLACEMENT_RULES}")


def expected_shard(full: Tensor, placement: str, rank: int, world_size: int) -> Tensor:
    """The part of `full` that `rank` holds under `placement` (padding included for flat-chunk)."""
    if placement == "flat-chunk":
        c = math.ceil(full.numel() / world_size)
        padded = full.new_zeros(c * world_size)
        padded[:full.numel()] = full.reshape(-1)
        return padded[rank * c:(rank + 1) * c]
    if placement == "dim0-chunk":
        if full.dim() == 0:
            return full if rank == 0 else full.new_empty((0,))
        chunks = torch.chunk(full, world_size, dim=0)
        return chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))
    if placement == "dim1-chunk":
        chunks = torch.chunk(full, world_size, dim=1)
        return chunks[rank] if rank < len(chunks) else full.new_empty((full.shape[0], 0, *full.shape[2:]))
    raise ValueError(f"unknown shard placement {placement!r}; one of {PLACEMENTS}")


def check_local_shards(scenario, adapter: str, records: dict[int, dict], repro: str) -> tuple[int, dict]:
    """Raise ConformanceError at the first shard that is not its slice; (comparisons, report details) otherwise."""
    count, placements, ranks_with, unspecified = 0, set(), 0, set()
    for rank, record in sorted(records.items()):
        seen = False
        for event in record.get("events", []):
            shards = event.get("shards")
            if shards is None or (event["kind"] == "backward" and not event.get("synced", True)):
                continue
            seen = True
            field = "grad" if event["kind"] == "backward" else "param"
            where = (f"step {event['step']} micro {event['micro']}, after backward" if event["kind"] == "backward"
                     else f"step {event['step']}, after the optimizer step")
            for name, shard in shards.items():
                full = event["values"].get(name)
                local = shard[field]
                placements.add(shard["placement"])
                if full is None or local is None:
                    if (full is None) != (local is None):
                        what = (f"this rank's {field} shard of {name!r} is "
                                f"{'set' if local is not None else 'None'} while the gathered {field} is "
                                f"{'None' if full is None else 'set'}")
                        raise ConformanceError(f"[{scenario.id}] adapter {adapter}: rank {rank}, {where}: {what}\n"
                                               f"  repro: {repro}")
                    continue
                rule = scenario.options.shard_placement
                # flat-chunk splits row-major: a dim-0 placement (uneven rows split mid-row), never dim 1
                asked_dim = placement_dim(rule, tuple(full.shape), scenario.world_size) if rule else None
                if rule and shard["placement"] not in ({f"dim{asked_dim}-chunk"} | ({"flat-chunk"} if asked_dim == 0 else set())):
                    asked = placement_dim(rule, tuple(full.shape), scenario.world_size)
                    raise ConformanceError(
                        f"[{scenario.id}] adapter {adapter}: rank {rank}, {where}: {name!r} ({tuple(full.shape)}) is "
                        f"sharded as {shard['placement']}, but the scenario's shard_placement_fn ({rule}) asks for "
                        f"dim {asked}: the engine ignored the placement function\n  repro: {repro}")
                # HSDP shards within the shard group: rank r*S + s holds position s of S (replicas equal)
                shard_ranks = scenario.world_size // (scenario.options.hsdp_replicas or 1)
                position = rank % shard_ranks
                want = expected_shard(full, shard["placement"], position, shard_ranks)
                if field == "param" and shard.get("param_padding") == "unspecified" and local.numel() == want.numel():
                    # Declared by the adapter (DeepSpeed ZeRO-3: its fp32 partition's padding is never
                    # written): only the real elements are compared, and the report says so.
                    real = min(want.numel(), max(0, full.numel() - position * want.numel()))
                    want, local = want[:real], local.reshape(-1)[:real]
                    unspecified.add(name)
                bad = compare_tensor(f"{name} ({field} shard, {shard['placement']})", want,
                                     local.reshape(want.shape) if local.numel() == want.numel() else local,
                                     EXACT_ACROSS_RANKS)
                count += 1
                if bad is not None:
                    raise ConformanceError(failure_message(
                        scenario_id=scenario.id, adapter=adapter, rank=rank, where=where,
                        what=(f"this rank's local {field} shard is not its slice of the gathered tensor "
                              f"(placement {shard['placement']}; padding must be zero)"),
                        mismatches=[bad], tol=EXACT_ACROSS_RANKS, repro=repro))
        ranks_with += seen
    if not ranks_with and scenario.options.shard_placement:
        raise ConformanceError(f"[{scenario.id}] adapter {adapter}: the scenario asks for a shard placement "
                               f"({scenario.options.shard_placement}) and no rank exposes its shards "
                               f"(Wrapped.local_shards), so the placement cannot be checked\n  repro: {repro}")
    if not ranks_with:
        return 0, {"local_shards": "not exposed by the adapter (Wrapped.local_shards): gathered tensors only"}
    details = {"local_shards": f"{count} shards bitwise equal to their slice ({', '.join(sorted(placements))})"}
    if unspecified:
        details["local_shards_declared"] = (f"parameter padding not checked (declared unspecified by the adapter) for "
                                            f"{len(unspecified)} parameter(s): {', '.join(sorted(unspecified))}")
    return count, details
