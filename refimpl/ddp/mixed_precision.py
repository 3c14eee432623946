"""``mixed_precision``: gradients reduced in a lower dtype, parameters kept as they are.

torch's DDP takes ``mixed_precision=_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)``;
with only ``reduce_dtype`` set it keeps parameters and buffers in their own dtype and
communicates gradients in ``reduce_dtype``. refimpl implements exactly that part: each
bucket is divided by the world size, cast to ``reduce_dtype``, all-reduced, and cast back
into the full-precision gradients (the built-in compression path of ``refimpl.ddp.comm_hooks``).
For low-precision *compute*, run the forward under ``torch.autocast``; ``param_dtype`` and
``buffer_dtype`` (low-precision parameter copies) are refused with that advice.

Tolerance: one step's gradients differ from a full-precision reduction by the rounding of
``reduce_dtype`` -- at most two of its ulps relative to the result (one for the cast of each
rank's share, one for the low-precision sum of two shares; more ranks add a rounding per
summand). Ranks still end bitwise identical: they all cast back the same reduced values.

Usage::

    >>> from torch.nn.parallel.distributed import _MixedPrecision
    >>> ddp = DDP(model, mixed_precision=_MixedPrecision(reduce_dtype=torch.bfloat16))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .comm_hooks import _compress_hook

__all__ = ["reduce_precision_hook"]


def reduce_precision_hook(mixed_precision, params: Sequence[torch.Tensor]) -> Callable | None:
    """The comm hook that implements ``mixed_precision`` (None when it changes nothing)."""
    if mixed_precision is None:
        return None
    dtypes = {p.dtype for p in params}
    param_dtype = getattr(mixed_precision, "param_dtype", None)
    if param_dtype is not None and dtypes != {param_dtype}:
        raise ValueError(
            f"refimpl DistributedDataParallel keeps parameters in their own dtype ({sorted(map(str, dtypes))}); "
            f"mixed_precision.param_dtype={param_dtype} is not supported: run the forward under torch.autocast "
            "for low-precision compute, and use reduce_dtype for low-precision communication"
        )
    if getattr(mixed_precision, "buffer_dtype", None) is not None:
        raise ValueError("refimpl DistributedDataParallel does not support mixed_precision.buffer_dtype; leave it None")
    reduce_dtype = getattr(mixed_precision, "reduce_dtype", None)
    if reduce_dtype is None or dtypes == {reduce_dtype}:
        return None
    if not (reduce_dtype.is_floating_point and torch.finfo(reduce_dtype).bits < max(torch.finfo(d).bits for d in dtypes)):
        raise ValueError(f"mixed_precision.reduce_dtype={reduce_dtype} must be a float dtype narrower than the parameters'")

    def reduce_in_lower_precision(process_group, bucket):
        return _compress_hook(reduce_dtype, process_group, bucket)

    return reduce_in_lower_precision
