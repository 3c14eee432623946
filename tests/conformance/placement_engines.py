"""DDP-like classes for the zero-adapter route's placement of 1/W (tests/conformance/test_ddp_placement.py).

refimpl's DDP sums the ranks' gradients and scales the sum (1/W "post"); torch's scales each
share first ("pre"). Both are exact averages: undeclared, either passes. `DeclaredPre` pins the
wrong one; `SlightlyScaled` is a real scaling error, a factor of 1 + 2**-19 on the average, below
any band but outside every exact placement.
"""

import torch
import torch.distributed as dist

from refimpl import DistributedDataParallel


class SumThenScale(DistributedDataParallel):
    """refimpl's DDP as a user would plug it in: no declaration."""


class DeclaredPost(DistributedDataParallel):
    gradparity_semantics = "post"


class DeclaredPre(DistributedDataParallel):
    gradparity_semantics = "pre"  # wrong: refimpl scales the sum


def _scaled_hook(factor: float):
    def hook(group, bucket):
        buffer = bucket.buffer()
        buffer.mul_(factor / dist.get_world_size(group))
        dist.all_reduce(buffer, group=group)
        future = torch.futures.Future()
        future.set_result(buffer)
        return future

    return hook


class SlightlyScaled(DistributedDataParallel):
    """Each share multiplied by (1 + 2**-19)/W before the sum: an average off by a relative 2**-19."""

    def __init__(self, module, process_group=None, **kwargs):
        super().__init__(module, process_group=process_group, **kwargs)
        self.register_comm_hook(process_group, _scaled_hook(1 + 2.0**-19))
