"""Knowing when a distributed backward pass has finished: credit recovery.

[Note: credit]
A backward pass spreads over workers as one-way gradient messages: a worker that receives
gradients runs its local part and sends the gradients of its received tensors on, to the
workers they came from. Nobody answers "my part and everything after it is done" (a chain of
such answers doubles the messages on the critical path: a 3-worker chain would wait for 4
answers after its 4 gradient messages). Instead the root holds a **credit** of 1 when the pass
starts, and every message carries a share of its sender's credit:

- a worker that sends gradients on splits the credit it received between those messages;
- a worker whose local run sends nothing (its part ends at leaves) hands its credit back to the
  root, with the set of workers on its path (so the root knows every worker the pass reached);
- a failure (an exception in a local run, or a message that could not be delivered, seen by its
  sender) hands the credit of that message back with the error.

Credit is exact: the pass is over when the credit returned to the root adds up to 1 again.
Messages can arrive in any order; no counter can dip to zero early. A credit is a pair of ints
``(numerator, denominator)`` in lowest terms, on the wire and in memory alike (:func:`add`,
:func:`split`): ``fractions.Fraction`` cost ~10 us per message in its Python-level operators,
and most messages only pass their credit on unchanged (one message in, one out).

[Note: the root's own messages]
Gradient messages addressed to the root itself (a fan-out's answers, the end of a chain) are
not run on the RPC thread that receives them: they are queued on the pass's tracker, and the
thread waiting in ``backward`` runs them once the credit they carry, plus the credit already
back, adds up to 1. At that moment no other message of the pass can exist (all credit is
accounted for), so every message that will ever reach the root's part of the graph in this
wave is in the queue and the nodes they share run once, not once per message. The price:
root-side work that depends on one branch only (a round trip out and back while another
branch is still running) waits for the slowest branch instead of overlapping with it.
Measured on the fan-out, running the shared nodes once wins (README, latency).
"""

from __future__ import annotations

import itertools
import threading
from math import gcd

Credit = tuple[int, int]  # (numerator, denominator), in lowest terms
FULL: Credit = (1, 1)
NONE: Credit = (0, 1)


def add(a: Credit, b: Credit) -> Credit:
    """``a + b``, exact."""
    if not a[0]:
        return b
    if not b[0]:
        return a
    num = a[0] * b[1] + b[0] * a[1]
    den = a[1] * b[1]
    g = gcd(num, den)
    return num // g, den // g


def split(credit: Credit, parts: int) -> Credit:
    """The share of each of ``parts`` messages: ``credit / parts``, exact."""
    if parts == 1:
        return credit
    num, den = credit[0], credit[1] * parts
    g = gcd(num, den)
    return num // g, den // g


def is_full(credit: Credit) -> bool:
    """Whether ``credit`` is all of it (or more: see :attr:`PassTracker.done`)."""
    return credit[0] >= credit[1]


class PassTracker:
    """The root's view of one backward pass: credit returned, workers reached, first error."""

    __slots__ = ("credit", "reached", "error", "_cond", "_queue", "_queued")

    def __init__(self, me: int) -> None:
        self.credit = NONE
        self.reached: set[int] = {me}
        self.error: tuple[int, str] | None = None
        self._cond = threading.Condition()
        self._queue: list = []  # gradient messages for the root's own send edges
        self._queued = NONE  # the credit they carry

    def returned(self, credit: Credit, reached, error: tuple[int, str] | None) -> None:
        with self._cond:
            self.credit = add(self.credit, credit)
            self.reached.update(reached)
            if error is not None and self.error is None:
                self.error = error
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        """All the credit is back. With an error the credit may be counted twice (a worker that
        forwarded its gradients and then died is reported by its sender too): over 1 is over
        as well."""
        return is_full(self.credit)

    def deliver(self, message, credit: Credit) -> None:
        """Queue a gradient message for the root's thread ([Note: the root's own messages])."""
        with self._cond:
            self._queue.append(message)
            self._queued = add(self._queued, credit)
            self._cond.notify_all()

    def next_work(self) -> list | None:
        """Wait until the pass is over (``None``) or the queued messages and the credit back
        add up to all the credit: then return the queued messages (their credit is the
        caller's to pass on or hand back)."""
        with self._cond:
            while True:
                if self.done:
                    return None
                if self._queue and is_full(add(self.credit, self._queued)):
                    batch, self._queue, self._queued = self._queue, [], NONE
                    return batch
                self._cond.wait()


class PassRegistry:
    """The passes this worker is root of, by pass id (ids are per root worker)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._passes: dict[int, PassTracker] = {}

    def start(self, me: int) -> tuple[int, PassTracker]:
        tracker = PassTracker(me)
        with self._lock:
            pass_id = next(self._ids)
            self._passes[pass_id] = tracker
        return pass_id, tracker

    def finish(self, pass_id: int) -> None:
        with self._lock:
            self._passes.pop(pass_id, None)

    def get(self, pass_id: int) -> PassTracker | None:
        """The tracker of a running pass; ``None`` once it ended (a late message of a pass
        that already ended with an error)."""
        with self._lock:
            return self._passes.get(pass_id)

    def returned(self, pass_id: int, credit: Credit, reached, error) -> None:
        tracker = self.get(pass_id)
        if tracker is not None:
            tracker.returned(credit, reached, error)


registry = PassRegistry()
