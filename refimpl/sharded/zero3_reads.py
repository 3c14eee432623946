"""Full and sharded reads of refimpl's ZeRO-3 engine: gathered gradients and parameters, each
rank's own chunks, full / sharded state dicts, and the global-norm clip (which reads every
shard's gradient) — a mixin of ``FullyShardedDataParallel``.

Why a module of its own: these are the engine's *outputs* (what users, checkpoints and the
suite read), apart from how it computes (``zero3.py``: gathering, resharding, reducing). They
rely on the engine's layout only: ``self._units`` (per unit and dtype, this rank's flat shard
``flats[dtype]``, each parameter's ``offset`` and ``chunk`` in it) and ``self._params`` (each
parameter's ``shard``, an ``nn.Parameter`` view of its chunk whose ``.grad`` is the sharded
gradient). A parameter of ``numel`` elements is split into ``W`` chunks of
``ceil(numel / W)`` elements, zero-padded at the end (``_chunk``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .clip import clip_shards_
from .engine import _all_gather_single
from .placement import from_layout, to_layout

__all__ = ["ShardReads"]


def _chunk(full: Tensor, chunk: int, rank: int, world_size: int) -> Tensor:
    """Rank ``rank``'s chunk of ``full``, flattened and zero-padded to ``chunk * world_size``."""
    padded = full.new_zeros(chunk * world_size)
    padded[:full.numel()] = full.reshape(-1)
    return padded[rank * chunk:(rank + 1) * chunk]


class ShardReads:
    """The reads of ``FullyShardedDataParallel`` (collectives where they rebuild full tensors)."""

    def _gather_shards(self, pick: Callable[..., Tensor | None]) -> dict[str, Tensor | None]:
        """Every parameter rebuilt from every rank's chunk picked by ``pick`` (a collective)."""
        out: dict[str, Tensor | None] = {}
        for unit in self._units:
            for dtype, group in unit.by_dtype().items():
                mine = unit.flats[dtype].new_zeros(unit.flats[dtype].numel())
                present = torch.tensor([0 if pick(q) is None else 1 for q in group], dtype=torch.int32,
                                       device=mine.device)
                for q in group:
                    if pick(q) is not None:
                        mine[q.offset:q.offset + q.chunk] = pick(q).detach()
                gathered = mine.new_empty(self.world_size * mine.numel())
                _all_gather_single(gathered, mine, group=self.process_group)
                rows = gathered.view(self.world_size, mine.numel())
                for q, has in zip(group, present.tolist(), strict=True):
                    out[q.name] = (from_layout(rows[:, q.offset:q.offset + q.chunk].reshape(-1)[:q.numel], q.shape,
                                               q.dim).clone()
                                   if has else None)
        return out

    def full_gradients(self) -> dict[str, Tensor | None]:
        """Unsharded reduced gradients by name (shard dtype); ``None`` where none was reduced. Collective."""
        self._assert_idle("full_gradients()")
        return self._gather_shards(lambda q: q.shard.grad)

    def full_parameters(self) -> dict[str, Tensor]:
        """Unsharded parameters by name, in the shards' dtype (copies). Collective.

        Frozen parameters (``requires_grad=False``) are not sharded: every rank holds them.
        """
        gathered = self._gather_shards(lambda q: q.shard)
        return {n: gathered[n] if n in gathered else p.detach().clone() for n, p in self.module.named_parameters()}

    def local_shards(self) -> dict[str, tuple[Tensor, Tensor | None]]:
        """This rank's (parameter chunk, gradient chunk) by name, padding included."""
        return {q.name: (q.shard.detach(), None if q.shard.grad is None else q.shard.grad.detach())
                for q in self._params}

    def full_state_dict(self) -> dict[str, Tensor]:
        """Parameters (unsharded, shard dtype) and buffers by name, on every rank. Collective."""
        state = dict(self.full_parameters())
        state.update({n: b.detach().clone() for n, b in self.module.named_buffers()})
        return state

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, Tensor]) -> None:
        """Take this rank's chunk of every parameter from a full state dict; buffers as they are."""
        for q in self._params:
            q.shard.copy_(_chunk(to_layout(state[q.name].to(q.shard.dtype), q.dim), q.chunk, self.rank, self.world_size))
        for n, b in self.module.named_buffers():
            if n in state:
                b.copy_(state[n])

    def sharded_state_dict(self) -> dict[str, dict]:
        """This rank's chunks with what it takes to check them on load (no communication)."""
        return {q.name: {"chunk": q.shard.detach().clone(), "shape": tuple(q.shape), "rank": self.rank,
                         "world_size": self.world_size} for q in self._params}

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict[str, dict]) -> None:
        for q in self._params:
            entry = state[q.name]
            if (entry["world_size"], entry["rank"], tuple(entry["shape"])) != (self.world_size, self.rank, tuple(q.shape)):
                raise ValueError(
                    f"sharded state of {q.name!r} is rank {entry['rank']} of {entry['world_size']} with shape "
                    f"{entry['shape']}; this is rank {self.rank} of {self.world_size} with shape {tuple(q.shape)}: "
                    "load a full state dict to change the world size")
            q.shard.copy_(entry["chunk"])

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the sharded gradients by their *global* norm (one all-reduce); returns the norm.

        pytorch/pytorch#170862 is the bug this avoids: the norm of the local shard alone.
        """
        grads = [q.shard.grad for q in self._params if q.shard is not None and q.shard.grad is not None]
        device = self._params[0].shard.device if self._params else torch.device("cpu")
        return clip_shards_(grads, max_norm, norm_type, self.process_group, device)
