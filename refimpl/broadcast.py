"""Broadcasting rank 0's state: construction-time sync and DDP's buffer rule.

Used by DistributedDataParallel and ShardedDataParallel alike; one flat message per
(dtype, device) keeps it to a handful of collectives however many tensors a model has.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def broadcast_from_rank0(tensors: list[torch.Tensor], group: dist.ProcessGroup, group_src: int = 0) -> None:
    """Overwrite ``tensors`` in place with group rank ``group_src``'s values (rank 0 unless joining)."""
    src = dist.get_global_rank(group, group_src)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for same in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in same:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
