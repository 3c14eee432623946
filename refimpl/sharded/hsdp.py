"""HSDP for refimpl's ZeRO-3 engine: shard within a group, replicate across groups.

Why: sharding over every rank makes each all-gather and reduce-scatter cross the whole world;
on a (replicas R, shards S) layout each unit's parameters are sharded over S ranks (one node,
say) and replicated R times, so the gathers stay inside the shard group and only the reduced
gradient chunks (1/S of the gradients) cross between replicas, in one all-reduce. The process
groups are passed explicitly: ``process_group`` (the S ranks this rank shards with) and
``replicate_group`` (the R ranks holding the same chunk as this rank), as FSDP2's 2-D
``DeviceMesh`` ("replicate", "shard") gives them.

What a replica pass adds to the engine (``ReplicaReduce``):

* construction and DDP's buffer rule: rank 0's state reaches every rank in two broadcasts,
  inside the shard group (from its first rank), then across replicas (from the replica whose
  shard group holds global rank 0);
* "who has a gradient": the count all-reduced inside the shard group is all-reduced across
  replicas too, so a parameter any rank used is reduced everywhere (a replica whose ranks never
  touched it sends zeros) and one no rank used keeps no gradient;
* the gradient: each share divided by ``S·R`` (``dp_size``), reduce-scattered inside the shard
  group, then the reduced chunks of one reduction all-reduced across replicas in one message;
* reduce-scatter-only accumulation (``set_requires_all_reduce(False)``, FSDP2's name): a
  synced backward reduce-scatters as usual but keeps each reduced chunk as a *partial*
  (reduce dtype, 1/S of a gradient per rank) instead of all-reducing it; the next backward that
  all-reduces adds its own chunk to the partial (``chunk + partial``, FSDP2's order) before
  the all-reduce. Partials whose parameter got no gradient in that backward are all-reduced
  at its end, in registration order (the same set on every rank: the counts are global).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..broadcast import broadcast_from_rank0

__all__ = ["ReplicaReduce"]


class ReplicaReduce:
    """The replica dimension of one engine (``group`` None: plain ZeRO-3, nothing to do)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group if group is not None and group.size() > 1 else None
        self.size = group.size() if group is not None else 1
        self.partials: dict[int, tuple[object, Tensor]] = {}  # id(_Param) -> (param, partial chunk)
        self._pending: list[tuple[object, Tensor]] = []

    def broadcast(self, tensors: list[Tensor], shard_group: dist.ProcessGroup) -> None:
        """Rank 0's values everywhere: inside the shard group, then across replicas."""
        broadcast_from_rank0(tensors, shard_group)
        if self.group is not None:
            broadcast_from_rank0(tensors, self.group)

    def count_users(self, used: Tensor) -> None:
        if self.group is not None:
            dist.all_reduce(used, group=self.group)

    def collect(self, q, reduced: Tensor, accumulate) -> None:
        """Bucketer callback: without replicas straight to ``accumulate``; else held for ``finish``."""
        if self.group is None:  # no replicas: nothing to all-reduce, nothing to keep (FSDP2 alike)
            accumulate(q, reduced)
        else:
            self._pending.append((q, reduced.clone()))

    @torch.no_grad()
    def finish(self, all_reduce: bool, accumulate, rest: bool = False) -> None:
        """After a reduction's flush: keep the chunks as partials, or add the partials and
        all-reduce them across replicas in one message per dtype (``rest``: also every partial
        no chunk of this backward met, at its end)."""
        pending, self._pending = self._pending, []
        if self.group is None:
            return
        if not all_reduce:
            for q, chunk in pending:
                held = self.partials.get(id(q))
                self.partials[id(q)] = (q, chunk if held is None else held[1].add_(chunk))
            return
        out, accumulated = [], False
        for q, chunk in pending:
            held = self.partials.pop(id(q), None)
            accumulated |= held is not None
            out.append((q, chunk if held is None else chunk.add_(held[1])))
        if rest and self.partials:
            out += sorted(self.partials.values(), key=lambda e: e[0].order)
            self.partials, accumulated = {}, True
        by_dtype: dict[torch.dtype, list[tuple[object, Tensor]]] = {}
        for q, chunk in out:
            by_dtype.setdefault(chunk.dtype, []).append((q, chunk))
        for entries in by_dtype.values():
            flat = torch.cat([c.reshape(-1) for _, c in entries])
            self.all_reduce_flat(flat, accumulated)
            offset = 0
            for _, c in entries:
                c.copy_(flat[offset:offset + c.numel()].view_as(c))
                offset += c.numel()
        for q, chunk in out:
            accumulate(q, chunk)

    def all_reduce_flat(self, flat: Tensor, accumulated: bool) -> None:
        """Sum ``flat`` across replicas (``accumulated``: it carries partials; the zoo's hook)."""
        dist.all_reduce(flat, group=self.group)
