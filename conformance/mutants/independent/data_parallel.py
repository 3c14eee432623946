"""Independent known-bad `data_parallel` implementations (issue 30), from `docs/contracts/data_parallel.md`.

`Correct` chains refimpl's public pieces (scatter_kwargs, replicate, parallel_apply, gather)
the way `torch.nn.parallel.data_parallel` does; each mutant overrides one step with a slip a
person writing that step could make. Every mutant is a full adapter of the area protocol
(`conformance.adapters.data_parallel`), including the optional `module_kwargs` keyword.

Dimensions (see the package docstring): `who` (replica 0 / another replica), `when` (state
read at which call), `how often`, `inputs`, `ambient` (grad mode, autocast, default dtype, in
the worker threads), `end of life` (does not apply: a call leaves nothing queued).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch

from conformance.mutants.firing import Fires
from conformance.mutants.registry import Registry
from conformance.spec import Capability
from refimpl._torch_compat import MODULE_BUFFERS
from refimpl.data_parallel import gather, parallel_apply, replicate, scatter_kwargs
from refimpl.data_parallel.devices import normalize_device, normalize_devices
from refimpl.nested import move_to

MUTANTS = Registry("indep-dp")


def mutant(name: str, clause: str, dimension: str, bug: str):
    """Register a mutant; `dimension` is the checklist column its slip belongs to."""
    def register(cls):
        cls.dimension = dimension
        return MUTANTS.mutant(name, clause, f"[{dimension}] {bug}")(cls)
    return register


class Correct(Fires):
    """The contract, built from refimpl's parts: the control every mutant here is judged against."""

    name = "indep-dp-correct"
    area = "data_parallel"
    version = "0"
    capabilities = frozenset({Capability.HALF_PRECISION, Capability.CUDA})
    bug, clause, may_abort, dimension = "", "", False, ""
    def devices(self, scenario) -> list:
        from conformance.adapters.data_parallel import devices_for

        return devices_for(scenario)

    def data_parallel(self, module, inputs, devices, output_device, dim, module_kwargs=None):
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        devs = normalize_devices(devices)
        out_dev = normalize_device(output_device) if output_device is not None else devs[0]
        args, kwargs = self.scatter(inputs, module_kwargs, devs, dim)
        k = len(args)
        replicas = self.replicate(module, devs[:k])
        outputs = self.apply(replicas, args, kwargs, devs[:k])
        if k == 1:
            return move_to(outputs[0], out_dev)
        return self.gather(outputs, out_dev, dim)

    # the four steps, each overridable
    def scatter(self, inputs, module_kwargs, devs, dim):
        return scatter_kwargs(inputs, module_kwargs, devs, dim)

    def replicate(self, module, devs):
        return replicate(module, devs, detach=not torch.is_grad_enabled())

    def apply(self, replicas, args, kwargs, devs):
        return parallel_apply(replicas, args, kwargs, devs)

    def gather(self, outputs, out_dev, dim):
        return gather(outputs, out_dev, dim)


def _run_in_threads(replicas, args, kwargs, states: list, inline: set[int] = frozenset()) -> list[Any]:
    """Replica i in its own thread (or in the caller's when i in `inline`), entering states[i]()
    there (a factory: `torch.set_grad_enabled` changes the mode of the thread that builds it)."""
    results: list[Any] = [None] * len(replicas)
    errors: list[BaseException] = []

    def work(i):
        try:
            with states[i]() if states[i] else contextlib.nullcontext():
                results[i] = replicas[i](*args[i], **kwargs[i])
        except Exception as exc:  # re-raised below, as parallel_apply does
            errors.append(exc)

    threads = []
    for i in range(len(replicas)):
        if i in inline:
            work(i)
        else:
            t = threading.Thread(target=work, args=(i,))
            t.start()
            threads.append(t)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _kwargs_differ(a: list[dict], b: list[dict]) -> bool:
    """Whether two per-replica kwargs lists differ (tensors compared by shape and value)."""
    if len(a) != len(b):
        return True
    for x, y in zip(a, b, strict=True):
        if x.keys() != y.keys():
            return True
        for key in x:
            u, v = x[key], y[key]
            if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                if not (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and u.shape == v.shape
                        and torch.equal(u, v)):
                    return True
            elif u is not v and u != v:
                return True
    return False


def _ambient_in_caller() -> bool:
    """Whether the caller has thread-local state a bare thread would not see."""
    return torch.is_autocast_enabled("cpu") or torch.is_inference_mode_enabled() or (
        torch.cuda.is_available() and torch.is_autocast_enabled("cuda"))


def _grad_mode_only():
    """A factory entering, in a worker, the grad mode of the thread that called this."""
    enabled = torch.is_grad_enabled()
    return lambda: torch.set_grad_enabled(enabled)


@mutant("threads-drop-autocast", "D15", "ambient",
        "worker threads re-enter the caller's grad mode but not its autocast state: replicas run in fp32 under autocast")
class ThreadsDropAutocast(Correct):
    def apply(self, replicas, args, kwargs, devs):
        self._fired(_ambient_in_caller())
        return _run_in_threads(replicas, args, kwargs, [_grad_mode_only() for _ in replicas])


@mutant("replica0-inline", "D15", "who",
        "replica 0 runs in the calling thread (all state), the others in bare threads: only replica 0 sees autocast")
class Replica0Inline(Correct):
    def apply(self, replicas, args, kwargs, devs):
        self._fired(len(replicas) > 1 and _ambient_in_caller())
        states = [None] + [_grad_mode_only() for _ in replicas[1:]]
        return _run_in_threads(replicas, args, kwargs, states, inline={0})


class _Pool:
    """A thread pool whose workers enter, for their whole life, the grad mode seen at creation."""

    def __init__(self, grad_enabled: bool):
        self.grad_enabled = grad_enabled

    def run(self, replicas, args, kwargs):
        return _run_in_threads(replicas, args, kwargs, [lambda: torch.set_grad_enabled(self.grad_enabled) for _ in replicas])


@mutant("pool-grad-mode-from-first-call", "D11", "when",
        "a persistent worker pool keeps the grad mode of the call that created it: a call under no_grad() "
        "followed by a training call gives replicas without a graph")
class PoolGradModeFromFirstCall(Correct):
    _pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its pool

    def apply(self, replicas, args, kwargs, devs):
        # visible only one way: a pool without grad mode under a training call (the other way the
        # replicas' graphs exist, but the gather in the caller's no_grad() cuts them off)
        self._fired(torch.is_grad_enabled() and not self._pool.grad_enabled)
        return self._pool.run(replicas, args, kwargs)

    def data_parallel(self, module, *rest, **kw):
        self._pool = self._pools.setdefault(module, _Pool(torch.is_grad_enabled()))
        return super().data_parallel(module, *rest, **kw)

    def replicate(self, module, devs):  # graph edges always built; the workers decide whether to record
        with torch.enable_grad():
            return replicate(module, devs)


@mutant("kwargs-unscattered", "D16", "inputs",
        "module_kwargs reach every replica whole (not split along dim)")
class KwargsUnscattered(Correct):
    def scatter(self, inputs, module_kwargs, devs, dim):
        args, right = scatter_kwargs(inputs, module_kwargs, devs, dim)
        wrong = [dict(module_kwargs or {}) for _ in args]
        self._fired(_kwargs_differ(wrong, right))
        return args, wrong


@mutant("kwargs-replica0-only", "D16", "who",
        "module_kwargs are scattered but only replica 0 receives its chunk; the others run with the module's defaults")
class KwargsReplica0Only(Correct):
    def scatter(self, inputs, module_kwargs, devs, dim):
        args, kwargs = scatter_kwargs(inputs, module_kwargs, devs, dim)
        wrong = [kwargs[0]] + [{} for _ in kwargs[1:]]
        self._fired(_kwargs_differ(wrong, kwargs))
        return args, wrong


@mutant("mode-read-once", "D10", "when",
        "replicas take the training flags cached at the first call: module.eval() after a training call is ignored")
class ModeReadOnce(Correct):
    _modes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def replicate(self, module, devs):
        modes = self._modes.setdefault(module, [m.training for m in module.modules()])
        self._fired(modes != [m.training for m in module.modules()])
        replicas = super().replicate(module, devs)
        for r in replicas:
            for m, training in zip(r.modules(), modes, strict=True):
                m.training = training
        return replicas


@mutant("probe-forward", "D9", "how often",
        "replica 0's forward runs twice: a first probe under no_grad() to learn the output structure, then the real one "
        "(train-mode BatchNorm updates its running statistics twice)")
class ProbeForward(Correct):
    def apply(self, replicas, args, kwargs, devs):
        before = [b.clone() for b in replicas[0].buffers()]
        with torch.no_grad():
            replicas[0](*args[0], **kwargs[0])
        self._fired(any(not torch.equal(b, c) for b, c in zip(before, replicas[0].buffers(), strict=True)))
        return super().apply(replicas, args, kwargs, devs)


@mutant("buffers-written-back-late", "D9", "when",
        "replica 0 updates copies of the buffers, written back into the original at the start of the next call")
class BuffersWrittenBackLate(Correct):
    _pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def replicate(self, module, devs):
        with torch.no_grad():
            for original, copy in self._pending.pop(module, []):
                original.copy_(copy)
        replicas = super().replicate(module, devs)
        pending = []
        for orig_m, rep_m in zip(module.modules(), replicas[0].modules(), strict=True):
            rep_buffers, orig_buffers = getattr(rep_m, MODULE_BUFFERS), getattr(orig_m, MODULE_BUFFERS)
            for key, b in list(rep_buffers.items()):
                if b is not None and not b.requires_grad and b is orig_buffers.get(key):
                    rep_buffers[key] = b.clone()
                    pending.append((b, rep_buffers[key]))
        self._pending[module] = pending
        return replicas

    def apply(self, replicas, args, kwargs, devs):
        outputs = super().apply(replicas, args, kwargs, devs)
        module_pending = [p for ps in self._pending.values() for p in ps]
        self._fired(any(not torch.equal(o, c) for o, c in module_pending))  # the original lacks the update now
        return outputs


@mutant("scalar-outputs-default-dtype", "D14", "ambient",
        "per-replica 0-dim outputs are written into torch.zeros(k): the vector takes the default dtype, not the outputs'")
class ScalarOutputsDefaultDtype(Correct):
    def gather(self, outputs, out_dev, dim):
        if all(isinstance(o, torch.Tensor) and o.dim() == 0 for o in outputs):
            self._fired(outputs[0].dtype != torch.get_default_dtype())
            vec = torch.zeros(len(outputs), device=out_dev)
            for i, o in enumerate(outputs):
                vec[i] = o.to(out_dev)
            return vec
        return super().gather(outputs, out_dev, dim)


@mutant("kwargs-batch-dim-zero", "D16", "inputs",
        "module_kwargs are scattered along dim 0 whatever `dim` is (positional inputs use `dim`)")
class KwargsBatchDimZero(Correct):
    def scatter(self, inputs, module_kwargs, devs, dim):
        args, _ = scatter_kwargs(inputs, None, devs, dim)
        if not module_kwargs:
            return args, [{} for _ in args]
        _, kwargs = scatter_kwargs((), module_kwargs, devs[:len(args)], 0)
        self._fired(_kwargs_differ(kwargs, scatter_kwargs(inputs, module_kwargs, devs, dim)[1]))
        return args, kwargs


def correct() -> Correct:
    return Correct()


globals().update(MUTANTS.factories())
