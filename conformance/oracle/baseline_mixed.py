"""The oracle's model of a sharded engine's mixed-precision policy (issue #26, clause S19).

FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` (FSDP1's ``MixedPrecision``, refimpl
ZeRO-3's ``MixedPrecisionPolicy``) changes *what is computed*, not only where it lives, so the
oracle models every cast exactly, per rank:

1. the fp32 master parameters are cast to ``param_dtype`` and the forward and backward run in
   ``param_dtype`` from those casts (floating inputs cast too: FSDP2's ``cast_forward_inputs``,
   FSDP1's root input cast, refimpl's forward): each rank's gradient is a ``param_dtype`` tensor
   computed with the kernels the rank uses;
2. each rank's gradient is cast to ``reduce_dtype`` (exact from bf16 to fp32) and the ranks'
   shares are reduced in ``reduce_dtype`` (`conformance.oracle.envelope.reduce`, every placement of 1/W
   the scenario declares: pre, post, FSDP's split);
3. the reduced gradient is cast back to the master dtype (exact from bf16 to fp32): that is the
   sharded gradient the optimizer steps, in fp32.

A correct engine is therefore *bitwise* the oracle wherever the cross-rank sum is order-free
(two ranks), bitwise to a summation order at four ranks with an fp32 reduce, and within the
derived bound of a ``reduce_dtype`` sum at four ranks with a bf16 reduce (`sharded_precision`
says which rule each scenario carries). An engine that computes in fp32 despite ``param_dtype``,
reduces in bf16 when fp32 was asked, or hands the optimizer a bf16 gradient differs.

Scope: one micro-batch per step (inside ``no_sync()`` FSDP2 accumulates in ``reduce_dtype`` where
it differs from ``param_dtype``, refimpl in ``param_dtype``: not modelled here), models without
floating buffers (FSDP2's policy casts parameters only).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import Tensor, nn

from conformance.oracle.envelope import Envelope

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def policy(scenario) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) of `scenario`'s mixed-precision policy (None: the parameter's)."""
    o = scenario.options
    param = getattr(o, "param_dtype", None)
    if not param:
        return None, None
    return DTYPES[param], DTYPES[o.reduce_dtype] if o.reduce_dtype else None


def applies(scenario) -> bool:
    return policy(scenario)[0] is not None


class _CastInputs(nn.Module):
    """Runs `low` (the parameters cast to param_dtype) on inputs cast to param_dtype."""

    def __init__(self, low: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.low, self.dtype = low, dtype

    def forward(self, *args, **kwargs):
        cast = lambda t: t.to(self.dtype) if isinstance(t, Tensor) and t.is_floating_point() else t  # noqa: E731
        return self.low(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})


def compute_module(model: nn.Module, params: list[nn.Parameter], scenario) -> tuple[nn.Module, list[nn.Parameter]]:
    """(module to forward, its parameters aligned with `params`) for one rank's forward and backward.

    Without a policy: `model` and `params` themselves. With one: a copy whose trainable
    parameters are the masters cast to param_dtype (buffers as they are), behind an input cast.
    """
    dtype = policy(scenario)[0]
    if dtype is None:
        return model, params
    memo = {id(p): nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad) for p in params}
    low = copy.deepcopy(model, memo)  # the memo maps each master to its cast: shared ones stay shared
    return _CastInputs(low, dtype), [memo[id(p)] for p in params]


def to_reduce_dtype(grad: Tensor | None, scenario) -> Tensor | None:
    """A rank's param_dtype gradient as it enters the reduction (cast to reduce_dtype)."""
    param, reduce = policy(scenario)
    if grad is None or param is None:
        return grad
    return grad.to(reduce or param)


def to_master_dtype(value, dtype: torch.dtype):
    """The reduced gradient (a tensor or an `Envelope`) cast back to the master dtype.

    From bf16/fp16 to fp32 the cast is exact, so every candidate of an envelope stays one; the
    bound's centre and radius are float64 already.
    """
    if value is None or value.dtype == dtype:
        return value
    if isinstance(value, Envelope):
        return replace(value, reference=value.reference.to(dtype),
                       candidates=None if value.candidates is None else value.candidates.to(dtype))
    return value.to(dtype)
