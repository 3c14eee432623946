"""``reshard_after_forward`` as an int: after a unit's forward, keep its parameters sharded over
a *smaller* group, so its backward all-gathers within that group only.

Why: the all-gather before a unit's backward crosses the whole world with ``True``; with
``False`` the full parameters stay in memory until the end of backward. An int ``k`` sits in
between (FSDP2's meaning, ``torch.distributed.fsdp.fully_shard``): after forward each rank
holds ``1/k`` of the unit's parameters, replicated across the ``W/k`` groups of ``k``
consecutive ranks (FSDP2 views its 1-D mesh as ``(W/k, k)``), and the backward's all-gather runs
inside the rank's group, e.g. within one node when ``k`` is the number of ranks per node.

Valid values on a group of ``W`` ranks are FSDP2's: ``k`` divides ``W``; ``1`` means ``False``
(keep everything) and ``W`` means ``True``; anything else is refused with what to pass.

[Note: post-forward layout]
A unit's gathered parameters of one dtype are ``W`` rows of ``n`` elements (row ``r`` is rank
``r``'s chunk of every parameter, end to end: see ``zero3._Unit``). Rank ``r``, at position
``j = r % k`` of its group, keeps rows ``[j·W/k, (j+1)·W/k)``; the group's all-gather of those
row blocks, in position order, is the ``W`` rows again, in order: the same values bit for bit
as the full all-gather (the compute dtype's values are copied, never recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

__all__ = ["PostForwardGroup", "post_forward_group"]


@dataclass(frozen=True)
class PostForwardGroup:
    """This rank's group of ``size`` consecutive ranks and its ``position`` in it."""

    size: int
    position: int
    group: dist.ProcessGroup
    world_size: int

    def rows(self) -> slice:
        """The rows of a unit's ``(W, n)`` gathered layout this rank keeps after forward."""
        per = self.world_size // self.size
        return slice(self.position * per, (self.position + 1) * per)

    def regather(self, kept: Tensor, all_gather_single) -> Tensor:
        """The ``(W, n)`` rows again, from every group member's kept block (a group collective)."""
        out = kept.new_empty(self.size * kept.numel())
        all_gather_single(out, kept, group=self.group)
        return out.view(self.world_size, -1)


def post_forward_group(reshard_after_forward: bool | int, process_group: dist.ProcessGroup) -> bool | PostForwardGroup:
    """``True``/``False`` as they are; an int as FSDP2 reads it (see the module docstring).

    Creating the groups is collective over ``process_group``: every rank of it makes this call.
    """
    if isinstance(reshard_after_forward, bool):
        return reshard_after_forward
    W = process_group.size()
    k = reshard_after_forward
    if not isinstance(k, int) or k < 1 or k > W or W % k:
        raise ValueError(
            f"reshard_after_forward={k!r}: pass True, False, or an int that divides the world size {W} "
            "(the size of the group each unit stays sharded over between its forward and its backward)")
    if k == 1:
        return False  # a group of one rank holds everything: FSDP2 reads 1 as False
    if k == W:
        return True
    members = dist.get_process_group_ranks(process_group)
    rank = dist.get_rank(process_group)
    start = rank - rank % k
    # Only the k members create their group (local synchronization): the other groups are
    # created by their own members, so no rank waits for a group it is not in.
    group = dist.new_group(members[start:start + k], use_local_synchronization=True)
    return PostForwardGroup(k, rank % k, group, W)
