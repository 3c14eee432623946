"""Interaction bugs in `data_parallel` implementations (issue 38), written from the contract alone.

Why this zoo: the hand-written catalogue turns one clause on against a default background, so a
bug that needs two things at once — two clauses, a replica count or split in its edge state, a
value regime, a dtype — can pass every scenario. Each mutant here is the independent zoo's
`Correct` (refimpl's public pieces chained as `torch.nn.parallel.data_parallel` does), correct
everywhere except where its two things meet; the bug text names the pair. Written from
`docs/contracts/data_parallel.md` without reading the scenario catalogue or its space.

`_fired()` is called only where the bug changed a value the correct chain would have produced
(a cast that rounded, a keyword that was dropped, autocast that a replica did not see). Run::

    gradparity zoo --area data_parallel --set interactions --profile standard
"""

from __future__ import annotations

import torch

from conformance.mutants.independent import data_parallel as independent
from conformance.mutants.independent.data_parallel import (
    _ambient_in_caller,
    _grad_mode_only,
    _run_in_threads,
)
from conformance.mutants.registry import Registry
from refimpl.nested import find_tensors

MUTANTS = Registry("ix-dp")


class Correct(independent.Correct):
    """The independent zoo's control, named for this zoo; it remembers how many devices it was given."""

    name = "ix-dp-correct"
    pair = ""

    def data_parallel(self, module, inputs, devices, output_device, dim, module_kwargs=None):
        self._devices = len(devices)
        return super().data_parallel(module, inputs, devices, output_device, dim, module_kwargs)


mutant = MUTANTS.interaction  # (name, clause, pair, bug): `pair` names the two things that must meet


@mutant("dim-detaches-inputs", "D8", "batch dim x input gradients",
        "the scatter is differentiable along dim 0 only: for any other `dim` it splits detached inputs, so inputs "
        "that require grad get none")
class DimDetachesInputs(Correct):
    def scatter(self, inputs, module_kwargs, devs, dim):
        if dim != 0 and torch.is_grad_enabled():
            self._fired(any(t.requires_grad for t in find_tensors(inputs)))
            inputs = _detached(inputs)
        return super().scatter(inputs, module_kwargs, devs, dim)


def _detached(obj):
    from conformance.models.data_parallel import map_leaves

    return map_leaves(obj, lambda t: t.detach() if isinstance(t, torch.Tensor) else t)


@mutant("fp64-reduce-through-fp32", "D12", "fp64 x continuous values",
        "the replicas' gradients are summed in a coalesced buffer of the default dtype (fp32): an fp64 parameter's "
        "gradient is rounded to fp32 (exact for small integers, not for continuous values)")
class Fp64ReduceThroughFp32(Correct):
    def replicate(self, module, devs):
        self._hooked = getattr(self, "_hooked", set())
        self._summing = len(devs) > 1
        for p in module.parameters():
            if p.requires_grad and p.dtype == torch.float64 and id(p) not in self._hooked:
                self._hooked.add(id(p))
                p.register_hook(self._round)
        return super().replicate(module, devs)

    def _round(self, grad):
        if not self._summing:
            return grad
        rounded = grad.float().to(grad.dtype)
        self._fired(not torch.equal(rounded, grad))
        return rounded


@mutant("no-grad-drops-autocast", "D15", "grad mode x autocast",
        "the no_grad() path runs the replicas in threads that re-enter grad mode only: under no_grad() and autocast "
        "the replicas compute in fp32")
class NoGradDropsAutocast(Correct):
    def apply(self, replicas, args, kwargs, devs):
        if torch.is_grad_enabled():
            return super().apply(replicas, args, kwargs, devs)
        self._fired(_ambient_in_caller())
        return _run_in_threads(replicas, args, kwargs, [_grad_mode_only() for _ in replicas])


@mutant("one-replica-tensor-kwargs", "D16", "one replica running x keyword arguments",
        "when one replica runs (one device, or one row) the shortcut calls it with the tensor keyword arguments "
        "only: a number keyword falls back to the module's default")
class OneReplicaTensorKwargs(Correct):
    def apply(self, replicas, args, kwargs, devs):
        if len(replicas) == 1:
            kept = {k: v for k, v in kwargs[0].items() if isinstance(v, torch.Tensor)}
            self._fired(kept.keys() != kwargs[0].keys())
            kwargs = [kept]
        return super().apply(replicas, args, kwargs, devs)


@mutant("fewer-rows-bare-threads", "D15", "fewer rows than replicas x autocast",
        "when the batch has fewer rows than devices, the trimmed set of replicas runs on a fallback path whose "
        "threads re-enter grad mode but not autocast")
class FewerRowsBareThreads(Correct):
    def apply(self, replicas, args, kwargs, devs):
        if len(replicas) >= self._devices or len(replicas) == 1:
            return super().apply(replicas, args, kwargs, devs)
        self._fired(_ambient_in_caller())
        return _run_in_threads(replicas, args, kwargs, [_grad_mode_only() for _ in replicas])


def correct() -> Correct:
    return Correct()


globals().update(MUTANTS.factories())
