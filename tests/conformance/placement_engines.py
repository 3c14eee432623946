"""DDP-like classes for the zero-adapter route's placement of 1/W (tests/conformance/test_ddp_placement.py).

DeepSpeed, pytorch-pfn-extras and torchft sum the ranks' gradients and scale the sum (1/W "post");
torch's and refimpl's DDP scale each share first ("pre"). Both are exact averages: undeclared,
either passes. `SumThenScale` is refimpl's DDP with a comm hook that places 1/W after the sum. `DeclaredPre` pins the
wrong one; `SlightlyScaled` is a real scaling error, a factor of 1 + 2**-19 on the average, below
any band but outside every exact placement.
"""

import torch
import torch.distributed as dist

from refimpl import DistributedDataParallel


def _sum_then_scale_hook(group, bucket):
    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=group)
    buffer.mul_(1.0 / dist.get_world_size(group))
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


class SumThenScale(DistributedDataParallel):
    """A DDP that scales the sum, as a user would plug it in: no declaration."""

    def __init__(self, module, process_group=None, **kwargs):
        super().__init__(module, process_group=process_group, **kwargs)
        self.register_comm_hook(process_group, _sum_then_scale_hook)


class DeclaredPost(SumThenScale):
    gradparity_semantics = "post"


class DeclaredPre(SumThenScale):
    gradparity_semantics = "pre"  # wrong: it scales the sum


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
