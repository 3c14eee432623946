"""The DDP algorithm with nothing but the algorithm: a teaching file and a test baseline.

Data parallelism keeps one replica of the model per rank; each rank runs forward and
backward on its own shard of the batch, then every gradient is replaced by the average over
the ranks, so one optimizer step on any rank equals a step on the whole batch:

    model = NaiveDataParallel(model, group)   # 1. same initial parameters everywhere
    model(x_shard).sum().backward()           # 2. local gradients
    model.all_reduce_gradients()              # 3. sum over ranks, divide by the world size
    optimizer.step()                          # 4. identical step on every rank

That is all of it. ``refimpl.ddp.DistributedDataParallel`` computes the same averages but
makes them cheap: it copies gradients into a few large flat buckets as backward produces
them and starts each bucket's all-reduce as soon as the bucket is full, so communication
overlaps the rest of backward (``reducer.py``). The tests check that it matches this file.

Deliberately left out (the real wrapper has them): buckets, overlap, ``no_sync``, unused
parameters, sparse gradients, comm hooks, join. One all-reduce per parameter, after
backward, in registration order — the same order on every rank, which is all a collective
needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["NaiveDataParallel"]


class NaiveDataParallel(nn.Module):
    """Wrap ``module``; call ``all_reduce_gradients()`` after each backward."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        # Step 1: every rank starts from rank 0's parameters and buffers.
        src = dist.get_global_rank(self.process_group, 0)
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=src, group=self.process_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def all_reduce_gradients(self) -> None:
        """Step 3: replace every gradient by its average over the ranks.

        Every rank must call this after the same backward. A parameter that got no gradient on
        this rank contributes zeros; one that no rank used keeps ``grad=None`` (as without data
        parallelism), which takes one small all-reduce of "who has a gradient" first.
        """
        group = self.process_group
        world_size = dist.get_world_size(group)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            return
        # On the parameters' device: NCCL takes only the rank's GPU tensors (device_check.py).
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
        dist.all_reduce(has_grad, group=group)
        for p, anyone in zip(params, has_grad.tolist(), strict=True):
            if not anyone:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)  # the sum over ranks ...
            p.grad.div_(world_size)  # ... divided by their number
