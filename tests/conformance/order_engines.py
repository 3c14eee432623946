"""Two DDP-like engines that differ only in the order they sum the ranks' gradients.

Both are refimpl's DDP with a comm hook that all-gathers every rank's share of a bucket (its
gradients divided by the world size) and adds the parts one by one: `AscendingSum` as rank 0 + rank 1 + … , `DescendingSum` from the last rank
down. Every rank adds in the same order, so ranks stay bitwise identical, and both pass the
oracle (a reordered fp32 sum of 3 terms is within its rule); but at 3 ranks the two orders
round differently, so their gradients differ in the last bits — what `gradparity compare`
must find and name (tests/conformance/test_recording_engines.py).
"""

import torch
import torch.distributed as dist

from refimpl import DistributedDataParallel


def _ordered_sum_hook(descending: bool):
    def hook(state, bucket):
        group = state
        buffer = bucket.buffer()
        world = dist.get_world_size(group)
        buffer.div_(world)  # each rank's share first, as torch's allreduce_hook divides before it sums
        parts = [torch.empty_like(buffer) for _ in range(world)]
        dist.all_gather(parts, buffer, group=group)
        total = None
        for r in (reversed(range(world)) if descending else range(world)):
            total = parts[r].clone() if total is None else total + parts[r]
        future = torch.futures.Future()
        future.set_result(total)
        return future

    return hook


class AscendingSum(DistributedDataParallel):
    descending = False

    def __init__(self, module, process_group=None, **kwargs):
        super().__init__(module, process_group=process_group, **kwargs)
        self.register_comm_hook(process_group, _ordered_sum_hook(self.descending))


class DescendingSum(AscendingSum):
    descending = True
