"""Uneven inputs: DDP as a ``torch.distributed.algorithms.Joinable``.

When ranks hold different numbers of batches, a rank that runs out first would leave the
others waiting in their gradient all-reduces forever. Under ``ddp.join()`` (or
``Join([ddp, ...])``) a rank that has run out *shadows* every collective the active ranks
issue in one training iteration, contributing zeros, until every rank has run out; then
all ranks take the final model of the last rank to run out.

One active iteration issues, in this order (``DistributedDataParallel._join_pre_forward``)::

    all_reduce(1)            "I have not joined"      (Join.notify_join_context; the joined
                                                        side is Join's own all_reduce(0))
    all_reduce(sync?)        does this iteration reduce gradients (1) or run no_sync (0)?
    broadcast(order)         the one-time bucket rebuild, where the reducer does it
    all_reduce(MAX rank) +   buffers, when they are synced: from the highest *active* rank
      broadcast(buffers)       (rank 0 may have joined with stale buffers), as torch does
    all_reduce(bucket) ...   the backward's buckets, then the used map (find_unused)

``JoinHook.main_hook`` below issues the same sequence with zeros. The averaging divisor is
the initial world size by default (a joined rank contributes a zero gradient), or the
number of active ranks with ``divide_by_initial_world_size=False``; comm hooks divide by
themselves, so with a hook the divisor is the hook's. Not supported under join (a clear
error): ``static_graph`` and sparse gradients (their collectives depend on hook counts and
index sets only an active rank knows).

Usage::

    >>> with ddp.join():                       # or Join([ddp], divide_by_initial_world_size=False)
    ...     for x in my_uneven_batches:        # rank 1 may have 0 batches
    ...         ddp(x).sum().backward(); opt.step(); opt.zero_grad()
    >>> # every rank now holds the model of the last rank to finish
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

__all__ = ["DDPJoinHook", "find_common_rank"]


def find_common_rank(rank: int, candidate: bool, group, device: torch.device) -> int:
    """The highest rank among those with ``candidate=True`` (every rank must call this)."""
    t = torch.tensor([rank if candidate else -1], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    src = int(t.item())
    if src < 0:
        raise RuntimeError("join: no rank qualified as the source of the model state (a refimpl bug)")
    return src


class DDPJoinHook(JoinHook):
    """What a joined refimpl DDP rank does while others still train (see module docstring)."""

    def __init__(self, ddp, divide_by_initial_world_size: bool = True) -> None:
        ddp._check_joinable()
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        super().__init__()

    def main_hook(self) -> None:
        """Shadow one iteration of the active ranks: the same collectives, with zeros."""
        ddp = self.ddp
        flag = torch.zeros(1, device=ddp.join_device)
        dist.all_reduce(flag, group=ddp.process_group)
        should_sync = bool(flag.item())
        if should_sync:
            ddp.reducer.prepare_for_forward()  # the bucket rebuild, if one is due
        if ddp._sync_buffers_this_forward():
            ddp._broadcast_buffers(active=False)
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the last rank to join (ties: the highest rank)."""
        ddp = self.ddp
        src = find_common_rank(dist.get_rank(ddp.process_group), is_last_joiner, ddp.process_group, ddp.join_device)
        ddp._sync_module_states(src)
