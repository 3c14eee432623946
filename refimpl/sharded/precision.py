"""The mixed-precision policy of refimpl's ZeRO-3 engine (FSDP2's ``MixedPrecisionPolicy``).

Why a module of its own: the policy touches three moments of a step — the all-gather (shards
cast to ``param_dtype``), the inputs (floating inputs cast to ``param_dtype``) and the gradient
(cast to ``reduce_dtype`` before the reduce-scatter, back to the shard's dtype after) — and one
more between steps: accumulation without sync.

[Note: accumulating in reduce_dtype]
Inside ``no_sync()`` a rank's gradients stay local and add up over micro-batches. Autograd adds
them in the parameter's compute dtype (``param_dtype``, e.g. bf16): every micro-batch after
the first would round the running sum to bf16 again. FSDP2 instead moves a local gradient to
``reduce_dtype`` as soon as its backward ends without sync (``FSDPParam.to_accumulated_grad_if_needed``)
and adds later micro-batches there (``accumulate_unsharded_grad_if_needed``), so the sum that
is finally reduced has been rounded to ``reduce_dtype`` only. A user asking for an fp32 reduce
expects fp32 accumulation, so refimpl does what FSDP2 does (``keep_local``); FSDP1 keeps the
sum in ``param_dtype`` (its flat parameter's ``.grad``) and casts once before the reduce-scatter
— the suite declares which each engine does (``conformance.semantics.MixedAccumulation``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["MixedPrecisionPolicy", "cast_floating", "keep_local"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's policy: compute in ``param_dtype``, reduce gradients in ``reduce_dtype``.

    ``None`` keeps the parameter's own dtype. Shards, the optimizer and ``full_*`` reads stay
    in the parameter's original dtype; the gathered parameter is the shard cast to
    ``param_dtype``, and the reduced gradient is cast back to the shard's dtype. A gradient
    accumulated without sync is kept in ``reduce_dtype`` ([Note: accumulating in reduce_dtype]).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


def keep_local(held: Tensor | None, param: Tensor, reduce_dtype: torch.dtype | None, syncing: bool) -> Tensor | None:
    """After ``param``'s gradient accumulated: the local sum held in ``reduce_dtype`` (moved out
    of ``param.grad``), or ``held`` unchanged where nothing needs widening: no reduce dtype, the
    gradient already in it, or a synced backward with nothing held before."""
    grad = param.grad
    if reduce_dtype is None or grad is None or grad.dtype == reduce_dtype or (held is None and syncing):
        return held
    param.grad = None
    return grad.to(reduce_dtype) if held is None else held.add_(grad)


def cast_floating(obj, dtype: torch.dtype):
    """``obj`` (tensors, nested in tuples, lists, dicts) with floating tensors cast to ``dtype``."""
    if isinstance(obj, Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj
