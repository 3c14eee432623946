"""Interaction bugs in distributed autograd engines (issue 38), written from the contract alone.

Why this zoo: the hand-written catalogue turns one clause on per composition (an async call, a
nested structure, an RRef, a hop, an error ...) against a plain background, so a bug that needs
two of them at once — or a dtype the catalogue never uses, or a second context after a first —
can pass every scenario. Each mutant here is the independent zoo's `Correct` (refimpl's engine
through the area's adapter), correct everywhere except where its two things meet; the bug text
names the pair. Written from `docs/contracts/dist_autograd.md` without reading the scenario
catalogue's space or its generated rows.

Every worker loads the adapter only when a function it runs calls back into it; a bug that lives
on a callee travels with the call (`_on_callee`: the target is wrapped, so the callee's part of
the engine runs the slip inside the context it was called in). `_fired()` is called only where
the bug changed what the correct engine does. Run::

    gradparity zoo --area dist_autograd --set interactions --profile standard
"""

from __future__ import annotations

import functools

import torch

from conformance.mutants.independent import dist_autograd as independent
from conformance.mutants.independent.dist_autograd import _current, _me
from conformance.mutants.registry import Registry

MUTANTS = Registry("ix-dist-autograd")
_WORKER_SHIFT = 48  # a context id's top 16 bits name the worker that opened it (contract A18)


class Correct(independent.Correct):
    """The independent zoo's control, named for this zoo."""

    name = "ix-dist-autograd-correct"
    pair = ""


mutant = MUTANTS.interaction  # (name, clause, pair, bug): `pair` names the two things that must meet


def _opened_here(context_id: int) -> bool:
    return context_id >> _WORKER_SHIFT == _me()


def _nested_grad_tensors(obj, depth=0) -> list:
    """Tensors requiring grad found inside a container (not a top-level argument)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if depth > 1 and obj.requires_grad else []
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _nested_grad_tensors(o, depth + 1)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _nested_grad_tensors(o, depth + 1)]
    return []


def _detach_nested(obj, depth=0):
    if isinstance(obj, torch.Tensor):
        return obj.detach() if depth > 1 else obj
    if isinstance(obj, tuple):
        return tuple(_detach_nested(o, depth + 1) for o in obj)
    if isinstance(obj, list):
        return [_detach_nested(o, depth + 1) for o in obj]
    if isinstance(obj, dict):
        return {k: _detach_nested(v, depth + 1) for k, v in obj.items()}
    return obj


@mutant("async-nested-args-detached", "A10", "rpc_async x nested arguments",
        "rpc_async has its own argument walk, which records the top-level tensors only: tensors inside "
        "tuples, lists and dicts of an asynchronous call travel detached (rpc_sync's walk is right)")
class AsyncNestedArgsDetached(Correct):
    def rpc_async(self, to, fn, args):
        if _current() is not None:  # args is the call's tuple: depth 1 is a top-level argument
            self._fired(bool(_nested_grad_tensors(args)))
            args = _detach_nested(args)
        return super().rpc_async(to, fn, args)


class _PlainFetch:
    """An RRef whose to_here() is torch's own fetch outside any context: a detached copy."""

    def __init__(self, rref):
        self._rref = rref

    def to_here(self):
        from refimpl.distributed_autograd.rpc import _torch_to_here

        return _torch_to_here(self._rref)


@mutant("hop-rref-detached", "A12", "remote() x a worker that did not open the context",
        "the RRef a remote() returns is tied to the context only where the context was opened: a remote() "
        "made by a callee (a hop) inside the context hands back an RRef whose to_here() is a detached copy")
class HopRRefDetached(Correct):
    def remote(self, to, fn, args):
        rref = super().remote(to, fn, args)
        ctx = _current()
        if ctx is None or _opened_here(ctx.context_id):
            return rref
        self._fired()
        return _PlainFetch(rref)


# -- a slip on the callee: the target is wrapped so that it runs there, in the call's context ------
_CARRY: dict[int, tuple] = {}  # id(tensor) -> (tensor, its last gradient here): tensors hash by id, compare by value
_CARRY_FIRED = [0]


def _carry_call(fn, args):
    """On the callee, inside the call's context: accumulate through the process-wide cache."""
    ctx = _current()
    if ctx is not None and not _opened_here(ctx.context_id) and not getattr(ctx, "_ix_carry", False):
        ctx._ix_carry = True
        ctx.accumulate = functools.partial(_carried_add, ctx)
        ctx.accumulate_all = functools.partial(_carried_add_all, ctx)
    return fn(*args)


def _carried_add_all(ctx, grads):
    with ctx.lock:
        for tensor, grad in grads.items():
            _carried_add(ctx, tensor, grad)


def _carried_add(ctx, tensor, grad):
    previous = ctx.grads.get(tensor)
    if previous is None and id(tensor) in _CARRY and not grad.is_sparse:
        previous = _CARRY[id(tensor)][1]  # the slip: a buffer left by an earlier context
        _CARRY_FIRED[0] += 1
    total = grad if previous is None else previous + grad
    ctx.grads[tensor] = total
    if not total.is_sparse:
        _CARRY[id(tensor)] = (tensor, total)


@mutant("callee-buffers-outlive-context", "A1", "a second context x a parameter owned by a callee",
        "a callee keeps one gradient buffer per tensor for the whole process, not per context: in a later "
        "context the gradient of a parameter it owns starts from what the earlier context left there")
class CalleeBuffersOutliveContext(Correct):
    @property
    def mutation_fired(self) -> int:  # counted on the callee, where no instance may exist
        return _CARRY_FIRED[0]

    @mutation_fired.setter
    def mutation_fired(self, value: int) -> None:
        _CARRY_FIRED[0] = value

    def _wrap(self, fn, args):
        if isinstance(fn, torch.jit.ScriptFunction) or _current() is None:
            return fn, args
        return _carry_call, (fn, tuple(args))

    def rpc_sync(self, to, fn, args):
        return super().rpc_sync(to, *self._wrap(fn, args))

    def rpc_async(self, to, fn, args):
        return super().rpc_async(to, *self._wrap(fn, args))

    def remote(self, to, fn, args):
        return super().remote(to, *self._wrap(fn, args))


_ASYNC_CONTEXTS: set[int] = set()


@mutant("async-path-error-swallowed", "A8", "an error on a remote backward x rpc_async",
        "the error of a failed remote part is collected through the sync calls' bookkeeping: when the "
        "context's calls went out by rpc_async, the backward returns normally and the error is lost")
class AsyncPathErrorSwallowed(Correct):
    def rpc_async(self, to, fn, args):
        ctx = _current()
        if ctx is not None:
            _ASYNC_CONTEXTS.add(ctx.context_id)
        return super().rpc_async(to, fn, args)

    def backward(self, context_id, roots, retain_graph=False):
        try:
            super().backward(context_id, roots, retain_graph)
        except RuntimeError:
            if context_id not in _ASYNC_CONTEXTS:
                raise
            self._fired()


_NESTED_SENT: dict[int, list] = {}  # context id -> leaves sent inside containers


@mutant("nested-unused-zero-filled", "A4", "an argument the callee ignores x nested structures",
        "a leaf that travels inside a container gets a zero gradient buffer in the context when it is sent "
        "(to accumulate into later); one the callee ignores keeps it: zeros, not absent")
class NestedUnusedZeroFilled(Correct):
    def _note(self, args):
        ctx = _current()
        if ctx is not None:
            leaves = [t for t in _nested_grad_tensors(args) if t.is_leaf]
            _NESTED_SENT.setdefault(ctx.context_id, []).extend(leaves)

    def rpc_sync(self, to, fn, args):
        self._note(args)
        return super().rpc_sync(to, fn, args)

    def rpc_async(self, to, fn, args):
        self._note(args)
        return super().rpc_async(to, fn, args)

    def remote(self, to, fn, args):
        self._note(args)
        return super().remote(to, fn, args)

    def get_gradients(self, context_id):
        grads = super().get_gradients(context_id)
        for leaf in _NESTED_SENT.get(context_id, []):
            if leaf not in grads:
                self._fired()
                grads[leaf] = torch.zeros_like(leaf)
        return grads


@mutant("fp32-sums-kept-fp64", "A2", "float32 tensors x a second contribution",
        "a later contribution to a gradient already in the context is summed in float64 for accuracy and the "
        "sum kept: a float32 gradient with two or more contributions comes out float64 (on the worker that "
        "opened the context)")
class Fp32SumsKeptFp64(independent.AccumulatingContext, Correct):
    def _combine(self, previous, grad):
        self._fired(previous.dtype == torch.float32)
        return previous.double() + grad.double()  # the slip: no cast back


def _reaches_rpc(root) -> bool:
    """Whether `root`'s graph holds a recv function (a tensor that came over RPC)."""
    seen, todo = set(), [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "Recv" in type(node).__name__ or "RecvFunction" in node.name():
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


@mutant("roots-local-part-dropped", "A6", "several roots x a root with no RPC in its graph",
        "with several roots the pass is started from the roots whose graphs reach an RPC (the distributed "
        "part); a purely local root among them is left out (a single root always runs)")
class RootsLocalPartDropped(Correct):
    def backward(self, context_id, roots, retain_graph=False):
        roots = list(roots)
        if len(roots) > 1:
            kept = [r for r in roots if _reaches_rpc(r)]
            if kept and len(kept) < len(roots):
                self._fired()
                roots = kept
        return super().backward(context_id, roots, retain_graph)


def correct() -> Correct:
    return Correct()


globals().update(MUTANTS.factories())
