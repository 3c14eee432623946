"""A context's lifetime: opening it on this thread, releasing it on every worker it reached,
and releasing the graph of a finished backward.

Kept apart from context.py (the state) because releasing sends messages (messaging.py), and
messaging needs the context container: the state module imports neither this module nor the
engine, so the package's imports form no circle.

torch's module-level names are here: ``context()``, ``_new_context()``, ``_release_context()``
and ``_get_max_id()``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

from torch.distributed import rpc

from . import messaging
from .context import DistAutogradContext, _tls, container, current_context
from .handlers import handler


# opening and closing ----------------------------------------------------------------------------
def _new_context() -> DistAutogradContext:
    """torch's ``_new_context()``: open a context and make it this thread's current one.

    Contexts do not nest: raises when the thread already has one. The caller releases it
    (``_release_context``); ``context()`` does both around a block.
    """
    active = current_context()
    if active is not None:
        raise RuntimeError(
            "Already have an autograd context id for this thread "
            f"(context {active.context_id}); distributed autograd contexts do not nest, "
            "exit the current `with context()` block first"
        )
    ctx = container().new_context()
    _tls.ctx = ctx
    return ctx


def _release_context(context_id: int) -> None:
    """torch's ``_release_context(id)``: release a context here and on every worker it reached;
    it stops being this thread's current context. Raises when it does not exist here."""
    container().retrieve(context_id)  # "Could not find autograd context with id: ..."
    active = current_context()
    if active is not None and active.context_id == context_id:
        _tls.ctx = None
    release_context(context_id)


def _get_max_id() -> int:
    """torch's ``_get_max_id()``: the largest context id this worker can hand out."""
    return container().max_id()


@contextlib.contextmanager
def context() -> Iterator[int]:
    """Open a distributed autograd context on this thread; yields its id.

    Usage::

        with refimpl.distributed_autograd.context() as context_id:
            loss = rpc_sync("worker1", torch.mul, args=(x, w)).sum()
            backward(context_id, [loss])
            grads = get_gradients(context_id)   # {x: ..., w: ...} on this worker
        # leaving the block releases the context here and on every worker it reached

    Contexts do not nest: opening one while this thread already has one raises.
    """
    ctx = _new_context()
    try:
        yield ctx.context_id
    finally:
        _tls.ctx = None
        release_context(ctx.context_id)


def release_context(context_id: int) -> None:
    """Delete ``context_id`` here now, and on every worker it reached without waiting (called
    on context exit).

    [Note: context release]
    Exiting a context sends one release to each worker the context reached, and each of those
    passes it on to the workers *it* reached; nobody waits for them, as with torch (its context
    exit sends its cleanup requests and returns). A round trip per reached worker on every
    context exit was a third of a parameter-server training step.

    A release must not overtake the message that creates the context there. To a worker the
    context sent a forward RPC through torch's agent (``ctx.rpc_workers``), the release is an
    RPC too: it follows, on the same agent, RPCs nobody waited for (a ``remote()`` never
    fetched), and a graceful ``rpc.shutdown()`` waits for it. To any other worker, everything
    this context sent went on the gradient channel (fetches by key, gradient messages, optimizer
    steps) and was waited for, so the release goes there too, as a message without an answer
    (messaging.py [Note: answers nobody needs]): a parameter server's trainer then pays neither
    the Python RPC's pickling nor its answer's callback on every step, and the server, whose
    Python serves every trainer, runs a few microseconds of it instead of an RPC.

    Context ids are not reused within one RPC world, so a late release cannot drop a newer
    context; a worker's debug info can show the context for the few messages' time it takes. A
    release RPC that fails (the worker is gone) is reported as a ``RuntimeWarning``; a release
    on the channel fails silently only when its receiver dies after it was written, and then
    there is no context left to release.
    """
    _release(context_id, sender=container().worker_id)  # as if this worker had been told


@handler
def _release(context_id: int, sender: int) -> None:
    """Drop ``context_id`` here and pass the release on to the workers it reached from here,
    ``sender`` excepted (see [Note: context release])."""
    cont = container()
    ctx = cont.pop(context_id)
    if ctx is None:
        return
    with ctx.lock:
        ctx.pending_releases.clear()  # the context release drops those graphs too
        targets = [w for w in ctx.known_workers if w not in (cont.worker_id, sender)]
        by_rpc = ctx.rpc_workers.intersection(targets)
    ctx.release_graph()
    channel = cont.channel
    for w in targets:
        args = (context_id, cont.worker_id)
        if w not in by_rpc and channel is not None and channel.call(w, _release, args, None):
            continue
        done = functools.partial(_release_answered, context_id, w)
        try:
            messaging.send_rpc(w, _release, args, done)
        except Exception as exc:
            done(None, f"{exc}")


def _release_answered(context_id: int, worker: int, answer, error: str | None) -> None:
    if error is not None:
        warnings.warn(
            f"could not release autograd context {context_id} on worker {worker}: {error}",
            RuntimeWarning,
            stacklevel=1,
        )


# the graph of a finished backward ---------------------------------------------------------------
def end_pass_on(ctx: DistAutogradContext, workers, me: int) -> None:
    """Release the graph of the pass here now, and on the other reached workers later.

    [Note: deferred release] Telling the other workers costs one message each; it is not paid
    on the backward's critical path. The workers are remembered and told before this context
    sends anything again (next RPC or backward: so a release can never clear send edges of
    a later forward); when the context exits first, the context release drops everything there
    anyway and the messages are never sent (the common case: one backward per context).
    """
    ctx.release_graph()
    with ctx.lock:
        ctx.pending_releases.extend(w for w in workers if w != me)


def drain_releases(ctx: DistAutogradContext) -> None:
    """Tell the workers of ``ctx.pending_releases`` to drop its graph; wait for them."""
    with ctx.lock:
        pending, ctx.pending_releases = ctx.pending_releases, []
    if not pending:
        return
    futs = [(w, rpc.rpc_async(w, _end_pass, args=(ctx.context_id,))) for w in pending]
    errors = []
    for worker, fut in futs:
        try:
            fut.wait()
        except Exception as exc:
            errors.append(f"worker {worker}: {exc}")
    if errors:
        warnings.warn(
            f"releasing the graph of autograd context {ctx.context_id} failed on "
            + "; ".join(errors),
            stacklevel=3,
        )


def _end_pass(context_id: int) -> None:
    """RPC target of ``drain_releases``: drop this worker's graph of ``context_id``."""
    ctx = container().lookup(context_id)
    if ctx is not None:
        ctx.release_graph()
