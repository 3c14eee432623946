"""Communication hooks with PyTorch's signature, and the bucket object they receive.

A comm hook decides how one bucket's flat gradient buffer is reduced:
``hook(state, bucket) -> torch.futures.Future[Tensor]``. The future's value is the
*averaged* buffer (the hook divides by the world size, the reducer does not), and the
reducer copies it back into the bucket if the hook returned a different tensor.

The built-in hooks here take a process group (or ``None`` for the default group) as state
and only use the public ``GradBucket`` methods, so they work unchanged when registered on
``torch.nn.parallel.DistributedDataParallel`` too. [Note: hook annotations] torch's DDP
inspects a hook: the bucket parameter must be called ``bucket`` and the annotations must be
absent or exactly ``dist.GradBucket`` / ``Future[Tensor]`` objects (string annotations from
``from __future__ import annotations`` are rejected), so the hooks carry none. It also
refuses a hook whose ``__name__`` is ``bf16_compress_hook`` unless NCCL is available, which is
why ours is registered under the name ``refimpl_bf16_compress_hook``: gloo reduces bf16 fine.

Usage::

    >>> ddp.register_comm_hook(state=None, hook=fp16_compress_hook)
    # the buffer travels as fp16 (half the bytes), the grads stay fp32
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "GradBucket",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
]


class GradBucket:
    """What a comm hook sees of one bucket (mirrors ``torch.distributed.GradBucket``).

    ``gradients()`` are views into ``buffer()`` shaped like the parameters, so a hook that
    edits the buffer edits exactly those gradients.
    """

    __slots__ = ("_index", "_buffer", "_params", "_views", "_is_last")

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        params: Sequence[torch.Tensor],
        views: Sequence[torch.Tensor],
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._params = list(params)
        self._views = list(views)
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        return list(self._views)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._is_last

    def __repr__(self) -> str:
        return (
            f"GradBucket(index={self._index}, numel={self._buffer.numel()}, "
            f"dtype={self._buffer.dtype}, params={len(self._params)}, is_last={self._is_last})"
        )


def _group(state):
    return state if state is not None else dist.group.WORLD


def allreduce_hook(process_group, bucket):
    """Average the bucket with one all-reduce (what the reducer does with no hook)."""
    group = _group(process_group)
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(group))
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _compress_hook(dtype, process_group, bucket):
    group = _group(process_group)
    buffer = bucket.buffer()
    # Divide before the cast: summing W values already divided by W keeps the low-precision
    # all-reduce in range where summing first could overflow fp16.
    compressed = buffer.to(dtype).div_(dist.get_world_size(group))
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f):
        # Write back in place so gradient_as_bucket_view grads see the result directly.
        buffer.copy_(f.value()[0])
        return buffer

    return fut.then(decompress)


def fp16_compress_hook(process_group, bucket):
    """All-reduce the bucket as fp16 (half the bytes); the result is cast back."""
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket):
    """All-reduce the bucket as bfloat16 (fp32's range, half the bytes)."""
    return _compress_hook(torch.bfloat16, process_group, bucket)


bf16_compress_hook.__name__ = "refimpl_bf16_compress_hook"  # see [Note: hook annotations]
