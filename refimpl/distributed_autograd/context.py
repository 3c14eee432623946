"""Distributed autograd contexts.

A context is the unit of one distributed forward + backward. It lives on every worker the
forward touched, keyed by one id: ``(worker_id << 48) | counter`` where ``worker_id`` is the
worker that opened it with :func:`context`. On other workers it is created on demand the first
time a message of that context arrives.

What a context owns on one worker (see :class:`DistAutogradContext`):

- the **send edges**: for every tensor requiring grad that left this worker, the gradient edge
  of the tensor's producer *as it was when sent* (functions.py [Note: send/recv pairs]), keyed
  by a per-worker send id;
- the **gradients** accumulated for leaf tensors of this worker's part of the graph
  (``get_gradients``) — never written to ``.grad``;
- the set of **known workers** (sent to or received from in this context), so that releasing
  the context reaches every worker the forward touched.

The current context is thread-local: each thread has at most one, nesting raises.
The container is one per process (per RPC agent), as the RPC agent itself is.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed import rpc

from .._torch_compat import current_rpc_agent_function
from .channel import Channel
from .channel import enabled as channel_enabled

_WORKER_ID_SHIFT = 48
_MAX_COUNTER = (1 << _WORKER_ID_SHIFT) - 1


@dataclass(eq=False)
class DistAutogradContext:
    """State of one distributed autograd context on one worker."""

    context_id: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Serializes local graph runs of this context on this worker (see local_run.py).
    run_lock: threading.Lock = field(default_factory=threading.Lock)
    # Serializes the handling of received gradient messages; while one is run, later ones of
    # the same pass wait in ``inbox`` ((root, pass id) -> messages) and are run together
    # (gradient_messages.py [Note: merged messages]).
    receive_lock: threading.Lock = field(default_factory=threading.Lock)
    inbox: dict = field(default_factory=dict)
    # send id -> (send edge: a torch.autograd.graph.GradientEdge, destination worker id)
    sends: dict[int, tuple[GradientEdge, int]] = field(default_factory=dict)
    grads: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    known_workers: set[int] = field(default_factory=set)
    # Workers this context sent a forward RPC through torch's agent (rpc.py): its release must
    # follow those RPCs on the agent (lifetime.py [Note: context release]).
    rpc_workers: set[int] = field(default_factory=set)
    # A zero-size leaf every RecvFunction hangs from, so received tensors require grad and
    # have a grad_fn (a valid backward root), like torch's RecvRpcBackward.
    anchor: torch.Tensor = field(default_factory=lambda: torch.empty(0, requires_grad=True))
    # Bumped when a backward with retain_graph=False ends: recv nodes created before it are
    # then stale (their send edges were released on the other side).
    graph_epoch: int = 0
    # Workers whose part of the graph a finished backward(retain_graph=False) released here but
    # not yet there: told before this context sends anything again (next RPC or backward), and
    # not at all when the context exits first (see lifetime.py [Note: deferred release]).
    pending_releases: list = field(default_factory=list)
    # message id -> the send function of one outgoing message (functions.SendRpcBackward), and
    # message id -> the recv node of one received message: torch's ``_send_functions()`` and
    # ``_recv_functions()``, dropped with the graph (``release_graph``).
    send_functions: dict = field(default_factory=dict)
    recv_functions: dict = field(default_factory=dict)
    _send_ids: Iterator[int] = field(default_factory=itertools.count)
    _message_ids: Iterator[int] = field(default_factory=itertools.count)
    # Local runs whose leaf gradients are still being added in, after their messages went out
    # (engine.py [Note: send first]); readers of ``grads`` wait for them (:meth:`gradients`).
    accumulating: int = 0
    accumulate_error: str | None = None  # why adding a run's gradients in failed, once it did
    accumulated: threading.Condition = field(init=False)  # on ``lock``: accumulating fell to 0
    # Held from a run's ``begin_accumulation`` to its ``end_accumulation``: runs add in in the
    # order they ran (``receive_lock`` orders the runs), so the sums come out the same each time.
    _adding: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.accumulated = threading.Condition(self.lock)

    def gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        """The gradients accumulated here, once every run's are in (a copy of ``grads``)."""
        with self.lock:
            while self.accumulating:
                self.accumulated.wait()
            if self.accumulate_error is not None:
                raise RuntimeError(self.accumulate_error)
            return dict(self.grads)

    def begin_accumulation(self) -> None:
        """A run's leaf gradients will be added in later: readers wait until
        :meth:`end_accumulation`. Called where the runs are ordered (the run's thread still
        holds ``receive_lock``); waits for the run before to finish adding in."""
        self._adding.acquire()
        with self.lock:
            self.accumulating += 1

    def end_accumulation(self, error: str | None = None) -> None:
        with self.lock:
            self.accumulating -= 1
            if error is not None and self.accumulate_error is None:
                self.accumulate_error = error
            if not self.accumulating:
                self.accumulated.notify_all()
        self._adding.release()

    # torch's names for the accessors tests and tools read ------------------------------------
    def _context_id(self) -> int:
        return self.context_id

    def _known_worker_ids(self) -> set[int]:
        with self.lock:
            return set(self.known_workers)

    def _send_functions(self) -> dict:
        """torch's ``_send_functions()``: message id -> send function (its ``next_functions``
        are the edges recorded for that message), in the order the messages were sent."""
        with self.lock:
            return dict(self.send_functions)

    def _recv_functions(self) -> dict:
        """torch's ``_recv_functions()``: message id -> the recv node of a received message."""
        with self.lock:
            return dict(self.recv_functions)

    def add_send_function(self, node) -> None:
        with self.lock:
            self.send_functions[next(self._message_ids)] = node

    def add_recv_function(self, node, origin: int) -> None:
        with self.lock:
            self.recv_functions[next(self._message_ids)] = node
            self.known_workers.add(origin)

    def add_send(self, edge: GradientEdge, dst: int) -> int:
        with self.lock:
            send_id = next(self._send_ids)
            self.sends[send_id] = (edge, dst)
            self.known_workers.add(dst)
        return send_id

    def accumulate(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` into this context's gradient for ``tensor`` (caller holds ``lock``).

        ``grad`` must be a buffer of its own (local_run.own_buffers): the first one is kept as is.
        """
        previous = self.grads.get(tensor)
        self.grads[tensor] = grad if previous is None else previous + grad

    def accumulate_all(self, grads: dict[torch.Tensor, torch.Tensor]) -> None:
        """:meth:`accumulate` every (leaf, gradient) of one local run, under one lock."""
        with self.lock:
            acc = self.grads
            for tensor, grad in grads.items():
                known = len(acc)
                previous = acc.setdefault(tensor, grad)  # one lookup for a first gradient
                if len(acc) == known:  # there was one
                    acc[tensor] = previous + grad

    def release_graph(self) -> None:
        """Drop the references this context keeps into the autograd graph."""
        with self.lock:
            self.sends.clear()
            self.send_functions.clear()
            self.recv_functions.clear()
            self.graph_epoch += 1


class ContextContainer:
    """All contexts of one worker (of one RPC agent), the counters behind the debug info, and
    the worker's end of the gradient channel (channel.py)."""

    def __init__(self, worker_id: int, agent: object = None) -> None:
        if not 0 <= worker_id < (1 << 16):
            raise ValueError(f"worker id must fit in 16 bits, got {worker_id}")
        self.worker_id = worker_id
        self.agent = agent
        self._channel: Channel | None = None
        # REFIMPL_DIST_AUTOGRAD_CHANNEL, read once per agent (not per message: reading the
        # environment is three Python calls); set to switch the channel on or off at run time
        self.use_channel = channel_enabled()
        self._closed = False  # the agent was replaced: no channel any more
        self._lock = threading.Lock()
        self._contexts: dict[int, DistAutogradContext] = {}
        self._counter = itertools.count()
        self._passes: dict[int, int] = {}  # context id -> backward passes running here

    # ids -----------------------------------------------------------------------------------
    def new_context(self) -> DistAutogradContext:
        counter = next(self._counter)
        if counter > _MAX_COUNTER:
            raise RuntimeError(f"worker {self.worker_id} ran out of autograd context ids")
        ctx = DistAutogradContext((self.worker_id << _WORKER_ID_SHIFT) | counter)
        with self._lock:
            self._contexts[ctx.context_id] = ctx
        return ctx

    def max_id(self) -> int:
        return (self.worker_id << _WORKER_ID_SHIFT) | _MAX_COUNTER

    @property
    def channel(self) -> Channel | None:
        """This worker's channel, or ``None`` when disabled (``use_channel``)."""
        if not self.use_channel:
            return None
        if self._channel is None:
            with self._lock:
                if self._channel is None and not self._closed:
                    self._channel = Channel(
                        self.worker_id, _peer_channel_address, self.agent, self._is_current
                    )
        return self._channel

    def _is_current(self) -> bool:
        try:
            return _current_agent() is self.agent
        except RuntimeError:  # no agent at all: shut down
            return False

    def close(self) -> None:
        """The agent is gone: close the channel (its connections belong to the old agent). Its
        unanswered calls are dropped, not failed: their callbacks would reach the new world."""
        with self._lock:
            self._closed = True
            channel = self._channel
        if channel is not None:
            channel.close(fail_calls=False)

    # lookup --------------------------------------------------------------------------------
    def retrieve(self, context_id: int) -> DistAutogradContext:
        with self._lock:
            ctx = self._contexts.get(context_id)
        if ctx is None:
            raise RuntimeError(
                f"Could not find autograd context with id: {context_id} on worker "
                f"{self.worker_id} (it was never created here, or was already released)"
            )
        return ctx

    def lookup(self, context_id: int) -> DistAutogradContext | None:
        with self._lock:
            return self._contexts.get(context_id)

    def get_or_create(self, context_id: int) -> DistAutogradContext:
        with self._lock:
            ctx = self._contexts.get(context_id)
            if ctx is None:
                ctx = self._contexts[context_id] = DistAutogradContext(context_id)
            return ctx

    def pop(self, context_id: int) -> DistAutogradContext | None:
        with self._lock:
            self._passes.pop(context_id, None)
            return self._contexts.pop(context_id, None)

    # backward-pass bookkeeping ---------------------------------------------------------------
    def pass_started(self, context_id: int) -> None:
        with self._lock:
            self._passes[context_id] = self._passes.get(context_id, 0) + 1

    def pass_started_in(self, context_id: int) -> DistAutogradContext:
        """:meth:`retrieve` and :meth:`pass_started` under one lock (a gradient message
        arrived); raises, counting nothing, when the context is not here."""
        with self._lock:
            ctx = self._contexts.get(context_id)
            if ctx is not None:
                self._passes[context_id] = self._passes.get(context_id, 0) + 1
                return ctx
        self.retrieve(context_id)  # raises with the reason, unless created just now:
        return self.pass_started_in(context_id)

    def pass_finished(self, context_id: int) -> None:
        with self._lock:
            left = self._passes.get(context_id, 0) - 1
            if left > 0:
                self._passes[context_id] = left
            else:
                self._passes.pop(context_id, None)

    def debug_info(self) -> dict[str, int]:
        with self._lock:
            return {
                "num_current_backward_passes": len(self._passes),
                "num_autograd_contexts": len(self._contexts),
            }


# process-wide container, bound to the RPC agent's worker id ------------------------------------
_container_lock = threading.Lock()
_container_instance: ContextContainer | None = None
_tls = threading.local()


_current_agent = current_rpc_agent_function()  # asked once per gradient message: one C call


def container() -> ContextContainer:
    """The container of this process's RPC agent (a new one when the agent was replaced)."""
    global _container_instance
    cont = _container_instance
    try:
        agent = _current_agent()
    except RuntimeError as exc:
        raise RuntimeError(
            "refimpl.distributed_autograd needs an initialized RPC agent: call "
            "torch.distributed.rpc.init_rpc(...) first"
        ) from exc
    if cont is not None and cont.agent is agent:
        return cont
    with _container_lock:
        old = _container_instance
        if old is not None and old.agent is agent:
            return old
        cont = _container_instance = ContextContainer(agent.get_worker_info().id, agent)
    if old is not None:
        old.close()
    return cont


def _channel_address() -> tuple[str, int, bytes]:
    """RPC target: this worker's channel address and token (channel.py)."""
    channel = container().channel
    if channel is None:
        raise RuntimeError(
            "its channel is switched off (REFIMPL_DIST_AUTOGRAD_CHANNEL=rpc there)"
        )
    return channel.address()


def _peer_channel_address(dst: int):
    """A future of worker ``dst``'s channel address (asked over RPC, never waited on here)."""
    return rpc.rpc_async(dst, _channel_address)


def current_context() -> DistAutogradContext | None:
    """The context active on this thread, or None."""
    return getattr(_tls, "ctx", None)


@contextlib.contextmanager
def _as_current(ctx: DistAutogradContext | None) -> Iterator[None]:
    """Make ``ctx`` the thread's current context for a block (used on RPC threads)."""
    previous = getattr(_tls, "ctx", None)
    _tls.ctx = ctx
    try:
        yield
    finally:
        _tls.ctx = previous


def _current_context() -> DistAutogradContext:
    """torch's ``_current_context()``: the thread's context object (raises if none)."""
    ctx = current_context()
    if ctx is None:
        raise RuntimeError("Current thread doesn't have a valid autograd context")
    return ctx


def current_context_id() -> int:
    ctx = current_context()
    if ctx is None:
        raise RuntimeError("Current thread has no distributed autograd context")
    return ctx.context_id


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """Gradients accumulated on *this* worker in ``context_id``, keyed by the leaf tensor."""
    return container().retrieve(context_id).gradients()


def _retrieve_context(context_id: int) -> DistAutogradContext:
    return container().retrieve(context_id)
