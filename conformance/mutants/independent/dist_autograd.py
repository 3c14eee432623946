"""Independent known-bad distributed autograd engines (issue 30), from `docs/contracts/dist_autograd.md`.

`Correct` is the `refimpl-dist-autograd` adapter with a fired count; each mutant changes one
method of it the way a person writing that piece of an engine could: the error it re-raises,
what a retained pass tells the other workers, the thread an asynchronous reply is unpacked on,
the walk over a result, how a second contribution is added, the bookkeeping a failed pass
undoes, a fast path for a context without RPCs, a second fetch of one RRef. Every worker loads
the adapter (the remote functions call back into it), so a mutant acting in `rpc_sync` acts on
every hop; one acting on a context acts where the context was opened (worker 0 in the suite).

Dimensions (see the package docstring): `who` (the node an error names), `when` (the context
read on the reply's thread), `how often` (a second retained pass, a second fetch, zero RPCs),
`inputs` (a dict result), `ambient` (the default dtype), `end of life` (the context's release
after a failed pass).
"""

from __future__ import annotations

import contextlib
import functools
import re

import torch

from conformance.adapters.dist_autograd import RefimplDistAutograd
from conformance.mutants.firing import Fires
from conformance.mutants.registry import Registry
from refimpl import _torch_compat as compat

MUTANTS = Registry("indep-dist-autograd")


def _da():
    import refimpl.distributed_autograd as da

    return da


def _me() -> int:
    from refimpl.distributed_autograd.context import container

    return container().worker_id


def _current():
    """This thread's current refimpl context, or None."""
    from refimpl.distributed_autograd.context import current_context

    return current_context()


class Correct(Fires, RefimplDistAutograd):
    """refimpl's engine through the area's adapter: the control the mutants here are judged against."""

    name = "indep-dist-autograd-correct"
    bug, clause, may_abort, dimension = "", "", False, ""

def mutant(name: str, clause: str, dimension: str, bug: str, **kw):
    """Register a Correct subclass as mutant `name`; `dimension` is its checklist column."""
    def register(cls):
        cls.dimension = dimension
        return MUTANTS.mutant(name, clause, f"[{dimension}] {bug}", **kw)(cls)
    return register


# -- who -------------------------------------------------------------------------------------------
_NODE = re.compile(r"^(Error on Node \d+: )+")


@mutant("error-names-caller", "A8", "who",
        "a failed backward is re-raised as 'Error on Node <this worker>: ...' with the prefixes it came with "
        "stripped: the error names the caller, not the worker whose backward failed")
class ErrorNamesCaller(Correct):
    def backward(self, context_id, roots, retain_graph=False):
        try:
            super().backward(context_id, roots, retain_graph)
        except RuntimeError as exc:
            text, me = str(exc), _me()
            self._fired(not text.startswith(f"Error on Node {me}: "))
            raise RuntimeError(f"Error on Node {me}: {_NODE.sub('', text)}") from None


# -- how often -------------------------------------------------------------------------------------
@mutant("retain-releases-remote-graph", "A5", "how often",
        "retain_graph=True is honoured on the calling worker only: after every pass the other workers are told "
        "to drop the context's graph, so a second pass fails (or loses their part)")
class RetainReleasesRemoteGraph(Correct):
    def backward(self, context_id, roots, retain_graph=False):
        super().backward(context_id, roots, retain_graph)
        if retain_graph:
            ctx, me = _da()._retrieve_context(context_id), _me()
            with ctx.lock:
                others = [w for w in ctx.known_workers if w != me]
                ctx.pending_releases.extend(others)  # as after a final pass
            self._fired(bool(others))


@mutant("local-context-writes-grad", "A3", "how often",
        "a context that made no RPC takes a fast path, plain torch.autograd.backward, and copies the leaves' "
        ".grad into the context: .grad is written (and keeps what was in it before)")
class LocalContextWritesGrad(Correct):
    def backward(self, context_id, roots, retain_graph=False):
        from refimpl.distributed_autograd.local_run import collect_leaves

        ctx = _da()._retrieve_context(context_id)
        with ctx.lock:
            quiet = not ctx.known_workers and not ctx.sends and not ctx.recv_functions
        if not quiet:
            return super().backward(context_id, roots, retain_graph)
        self._fired()
        leaves, _, _ = collect_leaves([r.grad_fn for r in roots])
        torch.autograd.backward(list(roots), retain_graph=retain_graph)
        with ctx.lock:
            for leaf in leaves:
                if leaf.grad is not None:
                    ctx.grads[leaf] = leaf.grad.clone()


_SEEN_FETCHES: dict[int, tuple[object, set]] = {}  # context id -> (mutant, ids of RRefs fetched in it)


def _install_fetch_hook() -> None:
    """Wrap `RRef.to_here` once (the wrapper changes nothing outside this mutant's contexts)."""
    cls = compat.rref_class()
    original = cls.to_here
    if getattr(original, "_indep_second_fetch", False):
        return

    def to_here(self, *args, **kwargs):
        value = original(self, *args, **kwargs)
        ctx = _current()
        entry = _SEEN_FETCHES.get(ctx.context_id) if ctx is not None else None
        if entry is None:
            return value
        owner, seen = entry
        if id(self) not in seen:
            seen.add(id(self))
            return value
        owner._fired()
        return _detach(value, lambda _container: True)

    to_here._indep_second_fetch = True
    cls.to_here = to_here


@mutant("rref-second-fetch-detached", "A12", "how often",
        "the fast path for a later fetch of an RRef already fetched in the context (by key) forgets to attach "
        "the recv function: the second to_here() of one RRef comes back detached")
class RRefSecondFetchDetached(Correct):
    @contextlib.contextmanager
    def context(self):
        _install_fetch_hook()
        with super().context() as context_id:
            _SEEN_FETCHES[context_id] = (self, set())
            try:
                yield context_id
            finally:
                _SEEN_FETCHES.pop(context_id, None)


# -- when ------------------------------------------------------------------------------------------
@mutant("async-reply-outside-context", "A10", "when",
        "an rpc_async reply is unpacked in the future's callback against the current context read there, on "
        "the RPC thread, where there is none: the reply's tensors come back detached")
class AsyncReplyOutsideContext(Correct):
    def rpc_async(self, to, fn, args):
        from torch.distributed import rpc

        from refimpl.distributed_autograd import rpc as da_rpc
        from refimpl.distributed_autograd.functions import WireTensor, _map, unpack

        if _current() is None:
            return super().rpc_async(to, fn, args)
        _, dst, call_args = da_rpc._prepare(to, fn, args, None)
        fut = rpc.rpc_async(to, da_rpc._remote_call, args=call_args)

        def attach(done):
            now = _current()  # the slip: read here, not captured at the call
            if now is None:
                self._fired()
                return _map(done.value(), lambda t: t.tensor if isinstance(t, WireTensor) else t)
            with torch.enable_grad():
                return unpack(now, dst, done.value())

        return fut.then(attach)


# -- inputs ----------------------------------------------------------------------------------------
def _detach(obj, in_dict, inside=False):
    """`obj` with the tensors for which `in_dict(inside a dict)` holds detached."""
    if isinstance(obj, torch.Tensor):
        return obj.detach() if in_dict(inside) and obj.requires_grad else obj
    if isinstance(obj, tuple):
        items = [_detach(o, in_dict, inside) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_detach(o, in_dict, inside) for o in obj]
    if isinstance(obj, dict):
        return type(obj)((k, _detach(v, in_dict, True)) for k, v in obj.items())
    return obj


def _tensors_in_dicts(obj, inside=False) -> int:
    if isinstance(obj, torch.Tensor):
        return int(inside and obj.requires_grad)
    if isinstance(obj, (tuple, list)):
        return sum(_tensors_in_dicts(o, inside) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensors_in_dicts(v, True) for v in obj.values())
    return 0


@mutant("dict-results-detached", "A9", "inputs",
        "the walk that attaches a reply's tensors to the recv function visits tuples and lists but not dicts: "
        "tensors in a dict result come back detached (the callee's part never gets a gradient)")
class DictResultsDetached(Correct):
    def rpc_sync(self, to, fn, args):
        result = super().rpc_sync(to, fn, args)
        if _current() is None:
            return result
        self._fired(_tensors_in_dicts(result) > 0)
        return _detach(result, lambda inside: inside)


class AccumulatingContext:
    """A mixin: the context this engine opens (on the worker that opened it) sums a later dense
    contribution to a gradient it already holds with `_combine(previous, grad)` (the mutant's own);
    the first one, and sparse ones, as the engine does."""

    @contextlib.contextmanager
    def context(self):
        with super().context() as context_id:
            ctx = _da()._retrieve_context(context_id)
            ctx.accumulate = functools.partial(self._accumulate, ctx)  # this context only
            ctx.accumulate_all = functools.partial(self._accumulate_all, ctx)  # the engine's one-lock form
            yield context_id

    def _accumulate_all(self, ctx, grads):
        with ctx.lock:
            for tensor, grad in grads.items():
                self._accumulate(ctx, tensor, grad)

    def _accumulate(self, ctx, tensor, grad):
        previous = ctx.grads.get(tensor)
        if previous is None or grad.is_sparse or previous.is_sparse:
            ctx.grads[tensor] = grad if previous is None else previous + grad
            return
        ctx.grads[tensor] = self._combine(previous, grad)  # each mutant's own slip


# -- ambient ---------------------------------------------------------------------------------------
@mutant("accumulate-default-dtype", "A2", "ambient",
        "a later contribution to a gradient already in the context is added into a fresh torch.zeros(shape) "
        "(the default dtype, float32): float64 gradients that accumulate (a retained pass, a second run) are "
        "rounded to float32 (here on the worker that opened the context)")
class AccumulateDefaultDtype(AccumulatingContext, Correct):
    def _combine(self, previous, grad):
        self._fired(grad.dtype != torch.get_default_dtype())
        total = torch.zeros(grad.shape, device=grad.device)  # the slip: no dtype=
        total += previous
        total += grad
        return total


# -- end of life -----------------------------------------------------------------------------------
@mutant("failed-pass-forgets-workers", "A7", "end of life",
        "when a backward fails, undoing the pass's bookkeeping also clears the context's set of workers it "
        "reached: the context exit then releases it nowhere else, and it stays on every other worker")
class FailedPassForgetsWorkers(Correct):
    def backward(self, context_id, roots, retain_graph=False):
        try:
            super().backward(context_id, roots, retain_graph)
        except Exception:
            ctx, me = _da()._retrieve_context(context_id), _me()
            with ctx.lock:
                self._fired(bool(ctx.known_workers - {me}))
                ctx.known_workers.clear()
            raise


def correct() -> Correct:
    return Correct()


globals().update(MUTANTS.factories())
