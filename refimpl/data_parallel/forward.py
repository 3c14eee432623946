"""data_parallel / DataParallel: scatter, replicate, parallel_apply, gather - in one call.

    out = data_parallel(model, x, devices=["cuda:0", "cuda:1"])   # or ["cpu", "cpu"]
    out.sum().backward()        # model's parameters now hold the full-batch gradients

Usage, the surprising cases::

    # A batch of 3 rows over 4 devices runs 3 replicas (no replica gets an empty batch).
    # 5 rows over 4 devices split 2, 1, 1, 1 (balanced; torch.nn.DataParallel does 2, 2, 1).
    # A per-replica 0-dim output (a loss) comes back as a vector, one entry per replica -
    # but as the 0-dim tensor itself when only one replica ran. Return per-row losses (or
    # sum them) so the gradient does not depend on the split.

The single-device shortcut: when only one replica would run and the module already lives
on that device, the module itself is called (no replication; inputs are moved to the
device, the output to `output_device`). If the module lives elsewhere it is replicated
onto the device, so its gradients still reach the original parameters - the module is
never moved behind the user's back.

Buffers: each call re-copies the original's buffers; the first replica on the original's
device updates the original's buffers in place (BatchNorm running stats in train mode
follow that replica's chunk, as in torch.nn.DataParallel). See replicate.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .devices import (
    DeviceLike,
    default_devices,
    device_context,
    normalize_device,
    normalize_devices,
)
from .parallel_apply import parallel_apply
from .replicate import ReplicaMisuseError, is_replica, replicate
from .scatter_gather import gather, move_to, scatter_kwargs

__all__ = ["DataParallel", "data_parallel"]


def _lives_on(module: nn.Module, device: torch.device) -> bool:
    tensors = list(module.parameters()) + list(module.buffers())
    return all(t.device == device for t in tensors)


def data_parallel(
    module: nn.Module,
    inputs: Any,
    devices: Sequence[DeviceLike] | None = None,
    output_device: DeviceLike | None = None,
    dim: int = 0,
    module_kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """Evaluate `module(*inputs, **module_kwargs)` with the batch split over `devices`.

    Args:
        module: the original module; its parameters receive the gradients.
        inputs: a tuple of positional arguments, or a single argument (anything that is
            not a tuple, e.g. one tensor or a dict).
        devices: where replicas run; a device may repeat (`["cpu"] * 4`). Default: all
            CUDA devices (RuntimeError if there are none).
        output_device: where the gathered output goes (default: `devices[0]`).
        dim: the batch dimension of every input tensor and output tensor.
        module_kwargs: keyword arguments, scattered like `inputs`.

    Matches the conformance data_parallel adapter seam
    `data_parallel(module, inputs, devices, output_device, dim)`.
    """
    if is_replica(module):
        replicate(module, ["cpu"])  # raises ReplicaMisuseError with the explanation
    devs = normalize_devices(devices) if devices is not None else default_devices()
    out_dev = normalize_device(output_device) if output_device is not None else devs[0]
    if not isinstance(inputs, tuple):
        inputs = (inputs,)

    args, kwargs = scatter_kwargs(inputs, module_kwargs, devs, dim)
    k = len(args)
    if k == 1:
        device = devs[0]
        if _lives_on(module, device):
            with device_context(device):
                out = module(*args[0], **kwargs[0])
            return move_to(out, out_dev)
        replicas = replicate(module, devs[:1], detach=not torch.is_grad_enabled())
        return move_to(parallel_apply(replicas, args, kwargs, devs[:1])[0], out_dev)

    replicas = replicate(module, devs[:k], detach=not torch.is_grad_enabled())
    outputs = parallel_apply(replicas, args, kwargs, devs[:k])
    return gather(outputs, out_dev, dim)


class DataParallel(nn.Module):
    """`torch.nn.DataParallel`-shaped wrapper around `data_parallel`.

    `DataParallel(module, device_ids=None, output_device=None, dim=0)`; `.module` is the
    wrapped module, so `state_dict()` keys carry the `module.` prefix as in torch, and an
    optimizer over `DataParallel(m).parameters()` steps `m`'s parameters. Unlike torch's
    class it does not fall back to calling the module when no CUDA device exists: it raises
    at construction; give `device_ids=["cpu"]` (or several) to run on the CPU.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
    ):
        super().__init__()
        if is_replica(module):
            raise ReplicaMisuseError(
                "DataParallel was given a replica made by replicate(); wrap the original module"
            )
        self.module = module
        self.device_ids = normalize_devices(device_ids) if device_ids is not None else default_devices()
        self.output_device = normalize_device(output_device) if output_device is not None else self.device_ids[0]
        self.dim = dim

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return data_parallel(self.module, inputs, self.device_ids, self.output_device, self.dim, kwargs)
