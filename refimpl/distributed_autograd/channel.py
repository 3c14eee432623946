"""A direct channel between workers for the backward pass's messages.

[Note: why a channel of its own]
A distributed backward is a relay of small messages: the 3-worker chain of
``benchmarks/dist_autograd_latency.py`` has four gradient messages on its critical path. As
Python-function RPCs through torch's TensorPipe agent each costs about 0.7 ms here: the agent's
thread hand-offs, the RPC pickler, and a response whose Python future callback competes for
the cores with the next hop. Over a TCP connection between the same processes, whose reader
thread runs the handler itself, the same message costs about 0.2 ms, answer included
(``benchmarks/dist_autograd_profile.py`` prints both). torch's own engine sends these messages
from C++; this channel is how a Python engine gets close to that.

What travels here: the engine's gradient messages and credit returns,
``DistributedOptimizer.step``'s calls and ``to_here``'s fetches by key, whose tensors are all
dense CPU tensors (``frames.carries``; the wire format is frames.py), and a context's release
to a worker it sent no forward RPC (lifetime.py [Note: context release]). Everything else
stays on torch's RPC agent: sparse gradients, CUDA gradients (the agent's device maps apply to
them), graph releases, the other context releases, and every RPC of the forward. Set
``REFIMPL_DIST_AUTOGRAD_CHANNEL=rpc`` to send everything through the agent (read when the
worker's context container is made, once per RPC agent; ``container().use_channel`` switches it
at run time).

Connections. One TCP connection per (sender, receiver) pair, opened in the background after
the first call (which goes over RPC, as does every call until the connection is open: [Note:
connecting never blocks a sender]): the sender asks the receiver for its address and token over
RPC, connects, waits for the receiver's greeting and only then presents the token
(handshake.py [Note: nothing is written to a listener that did not say who it is]).
On the receiver a reader thread per connection runs each call in order and writes the answer
back on the same connection; on the sender a reader thread hands each answer to its callback.
A call made without a callback asks for no answer (messaging.py [Note: answers nobody
needs]): the receiver runs it and writes nothing back.

Address: the channel listens where TensorPipe does: on the interface ``TP_SOCKET_IFNAME`` names,
else on the address the host name resolves to (TensorPipe's default). A run pinned to loopback
therefore opens nothing off loopback.

Security: like the RPC agent, which runs pickled Python from its peers, the channel unpickles
what it receives; a connection must first present a random token that only members of the RPC
group can fetch (over RPC), or it is closed unread.

Failures: when a connection breaks, its unanswered calls fail with the cause; a call
unanswered after the RPC timeout (``rpc.get_rpc_timeout()``) fails too. The engine hands the
credit of a failed call back with the error, as it does for a failed RPC.

[Note: an answer that rides along]
Most answers are empty: a gradient message's only says that the receiver ran it and sent its
gradients on. When the receiver sends them on to the very worker that called (a chain's far
end sends back to the worker before it), the answer rides in that message (the frame's ``ack``:
the sequence numbers of the calls it answers) instead of following it as a frame of its own,
which would wake the caller's answer reader while the caller runs the gradients it just got. A
handler that sends to its caller only as its last act, and then answers nothing, says so
(``handlers.defers_empty_answer``: the engine's gradient handler); the answer is then taken as
given, empty, and nothing more is written for the call. Such a handler's other empty answers
wait for the next frame to the caller (owed.py [Note: answers that wait]).

Blocking: a handler forwards gradients, so it sends. A send never blocks its caller on a full
socket: what does not fit is left to the connection's writer thread (connection.py [Note: a
write never blocks its thread]).

Lifetime: one channel per RPC agent (it lives in the context container, context.py); when the
agent is replaced (shutdown and init again) the old channel is closed.
"""

from __future__ import annotations

import itertools
import math
import os
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Callable

import torch
from torch.distributed import rpc

from . import handlers, handshake
from .connection import Connection, listen_address
from .frames import decode, encode, encode_empty_answer
from .owed import OwedAnswers, flush_after

ENV = "REFIMPL_DIST_AUTOGRAD_CHANNEL"
_NO_ANSWER = -1  # the sequence number of a call that asks for no answer

OnDone = Callable[[object, "str | None"], None]


def enabled() -> bool:
    """Whether the engine may use the channel (``REFIMPL_DIST_AUTOGRAD_CHANNEL`` is not ``rpc``)."""
    return os.environ.get(ENV, "socket").strip().lower() != "rpc"


# the channel --------------------------------------------------------------------------------------
class Channel:
    """This worker's end of the channel: one listener, outgoing connections, pending calls.

    [Note: connecting never blocks a sender]
    A sender never waits for a connection: the first message to a peer, and any message while
    its connection is being opened, is sent another way (``call`` returns ``False`` and
    messaging.py sends it as an RPC). Meanwhile the peer's address is fetched by an
    asynchronous RPC and the connection opened on a thread of its own. Messages are sent from
    RPC callbacks and channel threads, where a blocking RPC could stall the agent. A peer that
    cannot be reached (its channel switched off, a port a firewall closes) is remembered, with
    a warning, and its messages keep going over RPC.
    """

    def __init__(
        self,
        me: int,
        rpc_address: Callable[[int], torch.futures.Future],
        agent: object = None,
        is_current: Callable[[], bool] = lambda: True,
    ) -> None:
        self.me = me
        self._rpc_address = rpc_address  # (host, port, token) of a peer, fetched over RPC
        self._is_current = is_current  # whether this channel's RPC agent is still the process's
        self.agent = agent
        self._lock = threading.Lock()
        self._token = secrets.token_bytes(handshake.TOKEN_BYTES)
        self._listener: socket.socket | None = None
        self._out: dict[int, Connection] = {}
        self._connecting: set[int] = set()
        self.unreachable: dict[int, str] = {}  # peer -> why its messages go over RPC
        self._served: list[Connection] = []
        # seq -> (the connection it went on, on_done, deadline)
        self._calls: dict[int, tuple[Connection, OnDone, float]] = {}
        self._seq = itertools.count()
        self._watch: threading.Thread | None = None
        self._watch_wake = threading.Event()  # cuts the watch thread's sleep short
        self._owed = OwedAnswers()  # empty answers held back: owed.py
        self._watch_short = False  # the watch thread wakes every few ms (answers are held)
        self.closed = False
        self.calls_sent = 0  # for tests and curious users: calls made on this channel

    # receiving ---------------------------------------------------------------------------------
    def address(self) -> tuple[str, int, bytes]:
        """(host, port, token) of this worker's listener, started on the first ask."""
        with self._lock:
            if self.closed:
                raise RuntimeError("the distributed autograd channel of this worker is closed")
            if self._listener is None:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.bind((listen_address(), 0))
                listener.listen(64)
                self._listener = listener
                _thread(self._accept, "refimpl-channel-accept", listener)
            host, port = self._listener.getsockname()
            return host, port, self._token

    def _accept(self, listener: socket.socket) -> None:
        """Accept connections until ``close`` shuts the listener down; then close it here, where
        it is used (connection.py [Note: a descriptor outlives its users])."""
        try:
            while True:
                try:
                    sock, _ = listener.accept()
                except OSError:
                    return  # shut down
                _thread(self._serve, "refimpl-channel-serve", sock)
        finally:
            listener.close()

    def _serve(self, sock: socket.socket) -> None:
        """Greet, check the token, then run the peer's calls in order, answering each."""
        _tune(sock)
        peer = handshake.accept(sock, self._token)
        if peer is None:
            sock.close()
            return
        conn = Connection(sock, peer)
        with self._lock:
            if self.closed:
                conn.close("channel closed")
                return
            self._served.append(conn)
        try:
            with conn.reading() as rfile:  # connection.py [Note: a descriptor outlives its users]
                self._run_calls(conn, peer, rfile)
        finally:
            with self._lock:
                if conn in self._served:
                    self._served.remove(conn)

    def _run_calls(self, conn: Connection, peer: int, rfile) -> None:
        """Run the peer's calls in order, answering each, until the connection ends."""
        by_name, deferring = handlers.BY_NAME, handlers.DEFERRING
        try:
            while True:
                tail: list = []
                seq, fn, args, ack, has_tail = decode(rfile, tail)
                if ack is not None:  # see [Note: an answer that rides along]
                    for answered in ack:
                        self._answered(answered)
                if type(fn) is str:  # a handler by name (handlers.py)
                    fn = by_name.get(fn) or handlers.by_name(fn)
                if has_tail:
                    args = (*args, tail)
                if seq == _NO_ANSWER:
                    _run_unanswered(fn, args, self._is_current())
                    continue
                if not self._is_current():  # RPC was shut down (and maybe started again) here
                    answer, error = None, "the worker's RPC agent that this channel served is gone"
                else:
                    armed = fn in deferring  # its empty answer may wait (handlers.py)
                    _serving.call = (peer, seq) if armed else None
                    try:
                        answer, error = fn(*args), None
                    except Exception as exc:
                        answer, error = None, f"{exc}"
                    finally:
                        rode_along = armed and _serving.call is None
                        _serving.call = None
                    if armed and answer is None and error is None:
                        if not rode_along:  # owed.py [Note: answers that wait]
                            self._hold(peer, seq, conn)
                        continue
                try:
                    if answer is None and error is None:
                        frame = encode_empty_answer(seq)
                    else:
                        frame = encode((seq, answer, error))
                except Exception as exc:  # an answer that cannot be pickled
                    frame = encode((seq, None, f"the answer could not be sent back: {exc}"))
                conn.write(frame)
        except Exception as exc:  # the peer left, or sent what cannot be read: drop it
            conn.close(f"{exc}")

    # sending -----------------------------------------------------------------------------------
    def call(
        self, dst: int, fn, args: tuple, on_done: OnDone | None, tail: list | None = None
    ) -> bool:
        """Run ``fn(*args)`` on worker ``dst``; ``on_done(answer, None)`` or ``on_done(None,
        error)`` follows, once, on a channel thread (``on_done=None``: no answer, and nothing is
        kept of the call once written). Returns ``False``, having sent nothing and without
        calling ``on_done``, when there is no open connection to ``dst`` (one may be opening:
        [Note: connecting never blocks a sender]); the caller sends another way. ``tail``: a
        list of tensors, ``fn``'s last argument after ``args``, sent as the frame's tensors
        (frames.py [Note: a frame's tail])."""
        conn = self._out.get(dst)  # an open connection, without the lock (the common case)
        if conn is None or conn.closed is not None:
            conn = self._outgoing(dst)
            if conn is None:
                return False
        owed = self._owed.take(dst)  # ([Note: an answer that rides along])
        serving = getattr(_serving, "call", None)
        serving = serving[1] if serving is not None and serving[0] == dst else None
        ack = [seq for seq, _, _ in owed] if owed else []
        if serving is not None:
            ack.append(serving)
        ack = tuple(ack) if ack else None
        fn = handlers.NAMES.get(fn, fn)  # a registered name, else the function (pickled)
        has_tail = tail is not None
        if on_done is None:
            if self.closed:
                self._owed.put_back(dst, owed)
                return False
            try:
                conn.write(encode((_NO_ANSWER, fn, args, ack, has_tail), tail))
            except Exception:
                self._owed.put_back(dst, owed)
                return False  # no whole frame went out: the caller sends another way
            if serving is not None:
                _serving.call = None
            self.calls_sent += 1
            return True
        seq = next(self._seq)
        timeout = rpc.get_rpc_timeout()
        deadline = time.monotonic() + timeout if timeout > 0 else math.inf  # 0: no timeout
        with self._lock:
            if self.closed:
                self._owed.put_back(dst, owed)
                return False
            self._calls[seq] = (conn, on_done, deadline)
            if self._watch is None:
                self._start_watch()
        try:
            conn.write(encode((seq, fn, args, ack, has_tail), tail))
        except Exception:
            self._owed.put_back(dst, owed)
            with self._lock:
                mine = self._calls.pop(seq, None) is not None
            # A failed write sent no whole frame. If the connection's reader already failed
            # this call (it saw the close first), on_done has run: the call is not the caller's.
            return not mine
        if serving is not None:
            _serving.call = None
        self.calls_sent += 1
        return True

    def _answered(self, seq: int) -> None:
        """A call of ours was answered by a message of the peer's own ([Note: an answer that
        rides along]): as an empty answer on its connection would."""
        with self._lock:
            call = self._calls.pop(seq, None)
            if call is None:
                return
            conn = call[0]
            retired = self._out.get(conn.peer) is not conn and not self._uses(conn)
        _run_callback(call[1], None, None)
        if retired:  # replaced after a timeout, and its last call is answered
            conn.close("replaced after a timeout")

    def _outgoing(self, dst: int) -> Connection | None:
        with self._lock:
            if self.closed:
                return None
            conn = self._out.get(dst)
            if conn is not None and conn.closed is None:
                return conn
            if dst in self.unreachable or dst in self._connecting:
                return None
            self._connecting.add(dst)
        try:
            fut = self._rpc_address(dst)
        except Exception as exc:
            self._unreachable(dst, f"{exc}")
            return None
        fut.add_done_callback(lambda f: _thread(self._connect, "refimpl-channel-connect", dst, f))
        return None

    def _connect(self, dst: int, fut: torch.futures.Future) -> None:
        try:
            host, port, token = fut.wait()
            sock = handshake.connect(host, port, token, self.me)  # handshake.py [Note: nothing...]
            _tune(sock)
        except Exception as exc:
            self._unreachable(dst, f"{exc}")
            return
        conn = Connection(sock, dst)
        with self._lock:
            self._connecting.discard(dst)
            if self.closed:
                conn.close("channel closed")
                return
            self._out[dst] = conn
        _thread(self._read_answers, f"refimpl-channel-answers-{dst}", conn)

    def _unreachable(self, dst: int, why: str) -> None:
        with self._lock:
            self._connecting.discard(dst)
            if self.closed:
                return
            self.unreachable[dst] = why
        warnings.warn(
            f"refimpl distributed autograd: no direct channel to worker {dst} ({why}); its "
            "backward messages go over RPC, which is slower",
            stacklevel=2,
        )

    def _read_answers(self, conn: Connection) -> None:
        with conn.reading() as rfile:  # connection.py [Note: a descriptor outlives its users]
            try:
                while True:
                    seq, answer, error = decode(rfile)
                    with self._lock:
                        call = self._calls.pop(seq, None)
                        retired = self._out.get(conn.peer) is not conn and not self._uses(conn)
                    if call is not None:
                        _run_callback(call[1], answer, error)
                    if retired:  # replaced after a timeout, and its last call is answered
                        conn.close("replaced after a timeout")
                        return
            except Exception as exc:
                why = conn.closed or f"{exc}"
                conn.close(why)
                self._fail(lambda c: c is conn, f"connection to worker {conn.peer} lost: {why}")

    def _uses(self, conn: Connection) -> bool:
        """Whether an unanswered call went on ``conn`` (caller holds the lock)."""
        return any(c is conn for c, _, _ in self._calls.values())

    def _hold(self, peer: int, seq: int, conn: Connection) -> None:
        """Hold the empty answer to ``peer``'s call ``seq`` (owed.py [Note: answers that
        wait]); the watch thread is woken only when it sleeps long, not on every pass."""
        self._owed.hold(peer, seq, conn)
        if not self._watch_short:
            with self._lock:
                self._start_watch()
            self._watch_wake.set()

    def _start_watch(self) -> None:
        """Start the watch thread once (caller holds the lock)."""
        if self._watch is None and not self.closed:
            self._watch = _thread(self._watch_calls, "refimpl-channel-watch")

    def _watch_calls(self) -> None:
        """Write the answers held too long (owed.py), every ``flush_after`` while answers are
        being held (and for 2 s after the last), and fail the calls unanswered past their
        deadline (the RPC timeout). A timed-out call's connection stops taking new calls (the
        next message to that peer opens a new one) but stays open for the answers of its
        other calls, which other passes may be waiting for; it is closed once they are all
        answered (``_read_answers``) or have timed out too."""
        while not self.closed:
            try:
                wait = flush_after(rpc.get_rpc_timeout())
            except Exception:  # no RPC agent any more (the channel closes next)
                wait = flush_after(0)
            self._watch_short = bool(self._owed) or time.monotonic() - self._owed.last_held < 2.0
            self._watch_wake.wait(wait if self._watch_short else 1.0)
            self._watch_wake.clear()
            self._owed.write_due(time.monotonic() - wait)
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        """Fail the calls unanswered past their deadline (see ``_watch_calls``)."""
        with self._lock:
            late = [seq for seq, (_, _, deadline) in self._calls.items() if deadline < now]
            calls = [self._calls.pop(seq) for seq in late]
            retired = []
            for conn in {id(c): c for c, _, _ in calls}.values():
                if self._out.get(conn.peer) is conn:
                    del self._out[conn.peer]
                if not self._uses(conn):
                    retired.append(conn)
        for conn in retired:
            conn.close("its calls timed out")
        for conn, on_done, _ in calls:
            why = f"RPC ran for more than set timeout: no answer from worker {conn.peer}"
            _run_callback(on_done, None, why)

    def _fail(self, which: Callable[[Connection], bool], why: str) -> None:
        with self._lock:
            seqs = [seq for seq, (conn, _, _) in self._calls.items() if which(conn)]
            calls = [self._calls.pop(seq) for seq in seqs]
        for _, on_done, _ in calls:
            _run_callback(on_done, None, why)

    def close(self, fail_calls: bool = True) -> None:
        """Close the listener and every connection. Calls still unanswered fail, unless
        ``fail_calls`` is false: then they are dropped (the RPC agent they belong to is gone,
        and their callbacks would reach the next agent's world)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            listener, self._listener = self._listener, None
            conns = [*self._out.values(), *self._served]
            self._out.clear()
            if not fail_calls:
                self._calls.clear()
        self._watch_wake.set()
        self._owed.write_due(math.inf)  # owed.py [Note: answers that wait]
        if listener is not None:
            try:  # wakes the thread blocked in accept(), which closes the listener
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for conn in conns:
            conn.close("channel closed")
        if fail_calls:
            self._fail(lambda conn: True, "the distributed autograd channel was closed")


# The call whose handler this channel thread is running, as (caller, seq), until its answer is
# sent or has ridden along ([Note: an answer that rides along]).
_serving = threading.local()


def _run_unanswered(fn, args, current: bool) -> None:
    """Run a call that asks for no answer; nobody can be told that it failed, so a failure is
    reported as a warning (the engine's handlers for such calls do not raise)."""
    if not current:  # its RPC agent is gone: the call belongs to an ended world
        return
    try:
        fn(*args)
    except Exception as exc:
        warnings.warn(f"a distributed autograd channel call failed: {exc!r}", stacklevel=2)


def _run_callback(on_done: OnDone, answer, error) -> None:
    """Run a call's callback on a channel thread; a failing callback must not stop that thread
    (it would stop reading answers), so its error is reported as a warning."""
    try:
        on_done(answer, error)
    except Exception as exc:
        warnings.warn(f"a distributed autograd channel callback failed: {exc!r}", stacklevel=2)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _thread(target, name: str, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread
