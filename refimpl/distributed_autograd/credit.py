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

Credit is exact (``fractions.Fraction``): the pass is over when the credit returned to the root
adds up to 1 again. Messages can arrive in any order; no counter can dip to zero early.
"""

from __future__ import annotations

import itertools
import threading
from fractions import Fraction

FULL = Fraction(1)


def to_wire(credit: Fraction) -> tuple[int, int]:
    """Credit in a message: two ints (a pickled ``Fraction`` is re-parsed from a string)."""
    return credit.numerator, credit.denominator


def from_wire(wire: tuple[int, int]) -> Fraction:
    return Fraction(*wire)


class PassTracker:
    """The root's view of one backward pass: credit returned, workers reached, first error."""

    __slots__ = ("credit", "reached", "error", "done", "_lock")

    def __init__(self, me: int) -> None:
        self.credit = Fraction(0)
        self.reached: set[int] = {me}
        self.error: tuple[int, str] | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()

    def returned(self, credit: Fraction, reached, error: tuple[int, str] | None) -> None:
        with self._lock:
            self.credit += credit
            self.reached.update(reached)
            if error is not None and self.error is None:
                self.error = error
            # With an error the credit may be counted twice (a worker that forwarded its
            # gradients and then died is reported by its sender too): over 1 is over as well.
            if self.credit >= FULL:
                self.done.set()


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

    def returned(self, pass_id: int, credit: Fraction, reached, error) -> None:
        with self._lock:
            tracker = self._passes.get(pass_id)
        if tracker is not None:  # a late report of a pass that already ended with an error
            tracker.returned(credit, reached, error)


registry = PassRegistry()
