"""Empty answers a channel holds back, to send inside its next message to the caller.

[Note: answers that wait]
A gradient message between two workers that are not the root is answered only so its sender
can hand the message's credit back when the receiver fails, dies or times out: an empty answer
changes nothing on the sender but the record of the call. Written at once, that answer woke the
sender's answer reader at the worst moment, right after the receiver had sent the gradients
on: on a small machine the writer, the woken reader and the next hop's receiver then shared two
cores (a 3-worker chain: two such answers per backward, about 4% of it). A handler that declares
it (``handlers.defers_empty_answer``: the engine's gradient handler) has its empty answers
held here instead. Each rides in the ``ack`` of the next frame this worker writes to the caller
(the chain's middle worker writes to the root later in the same pass), or is written on its own
connection once it has waited ``flush_after(timeout)``: a small part of the RPC timeout, so a
held answer never makes its call time out. A channel that closes writes what it holds first.

What changes for the sender: it keeps the record of such a call a little longer; a receiver
that dies after handling the call but before the answer went out fails the call, so the pass
fails, as torch's pass fails when a worker of its graph dies before the pass ends.
"""

from __future__ import annotations

import threading
import time

from .frames import encode_empty_answer

_FLUSH_AFTER = 0.1  # seconds an empty answer waits at most for a message to ride in


def flush_after(timeout: float) -> float:
    """How long an answer may wait: 100 ms, or a quarter of a shorter RPC timeout (0: none).
    Long enough that the thread writing them wakes ten times a second at most while answers
    are held: every wake-up takes a core from a pass in flight."""
    return min(_FLUSH_AFTER, timeout / 4) if timeout > 0 else _FLUSH_AFTER


class OwedAnswers:
    """The empty answers one channel holds, per caller: (sequence number, the connection the
    call came on, when it was held)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_peer: dict[int, list[tuple[int, object, float]]] = {}
        self.last_held = -float("inf")  # when an answer was last held (monotonic)

    def hold(self, peer: int, seq: int, conn) -> None:
        """Hold the empty answer to ``peer``'s call ``seq`` (which came on ``conn``)."""
        now = time.monotonic()
        with self._lock:
            self._by_peer.setdefault(peer, []).append((seq, conn, now))
            self.last_held = now

    def take(self, peer: int) -> list:
        """The answers held for ``peer``, which are no longer held (they go in a frame to it)."""
        if not self._by_peer:  # the common case, without the lock
            return []
        with self._lock:
            return self._by_peer.pop(peer, [])

    def put_back(self, peer: int, entries: list) -> None:
        """Hold ``entries`` again (the frame that was to carry them was not written)."""
        if entries:
            with self._lock:
                self._by_peer.setdefault(peer, [])[:0] = entries

    def due(self, held_before: float) -> list[tuple[object, list[int]]]:
        """Take every answer held since before ``held_before`` (all: ``inf``), grouped as
        (connection, sequence numbers) to write there."""
        out: dict[int, tuple[object, list[int]]] = {}
        with self._lock:
            for peer, entries in list(self._by_peer.items()):
                n = 0  # entries are in the order they were held
                while n < len(entries) and entries[n][2] < held_before:
                    seq, conn, _ = entries[n]
                    out.setdefault(id(conn), (conn, []))[1].append(seq)
                    n += 1
                if n == len(entries):
                    del self._by_peer[peer]
                elif n:
                    self._by_peer[peer] = entries[n:]
        return list(out.values())

    def write_due(self, held_before: float) -> None:
        """Write the answers held since before ``held_before`` (all: ``inf``) on the
        connections their calls came on."""
        for conn, seqs in self.due(held_before):
            pieces = [piece for seq in seqs for piece in encode_empty_answer(seq)[0]]
            try:
                conn.write((pieces, []))
            except Exception:
                pass  # closed: its peer fails those calls when it sees the close

    def __bool__(self) -> bool:
        """Whether any answer is held (put back ones included)."""
        return bool(self._by_peer)
