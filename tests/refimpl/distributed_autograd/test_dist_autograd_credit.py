"""Credit recovery: the root knows a backward pass is over (credit.py [Note: credit])."""

from __future__ import annotations

import threading
from fractions import Fraction

from refimpl.distributed_autograd.credit import FULL, PassRegistry, PassTracker, from_wire, to_wire


def test_the_pass_is_over_only_when_all_credit_is_back_in_any_order():
    tracker = PassTracker(me=0)
    # the root split 1 between two messages; the second branch split again at worker 2
    shares = [Fraction(1, 2), Fraction(1, 4), Fraction(1, 4)]
    for credit, worker in zip(reversed(shares), (3, 2, 1), strict=True):
        assert not tracker.done
        tracker.returned(credit, {worker}, None)
    assert tracker.done
    assert tracker.reached == {0, 1, 2, 3} and tracker.error is None


def test_the_first_error_is_kept_and_double_counted_credit_still_ends_the_pass():
    tracker = PassTracker(me=0)
    tracker.returned(Fraction(1, 2), {1}, (1, "boom"))
    tracker.returned(Fraction(1, 2), {2}, (2, "later"))
    tracker.returned(Fraction(1, 2), {2}, None)  # reported by the sender and downstream too
    assert tracker.done and tracker.error == (1, "boom")


def test_registry_routes_by_pass_id_and_ignores_ended_passes():
    registry = PassRegistry()
    first, tracker = registry.start(me=0)
    second, other = registry.start(me=0)
    assert first != second
    registry.returned(first, FULL, {1}, None)
    assert tracker.done and not other.done
    registry.finish(second)
    registry.returned(second, FULL, {1}, None)  # late: no error, nothing to update
    assert not other.done


def test_credit_travels_as_two_ints():
    wire = to_wire(Fraction(1, 12))
    assert wire == (1, 12) and all(type(v) is int for v in wire)
    assert from_wire(wire) == Fraction(1, 12)


def test_the_roots_own_messages_wait_until_they_hold_all_outstanding_credit():
    tracker = PassTracker(me=0)
    tracker.deliver("first answer", Fraction(1, 4))
    tracker.returned(Fraction(1, 4), {3}, None)  # a branch ended at leaves elsewhere
    got = []
    waiter = threading.Thread(target=lambda: got.append(tracker.next_work()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "1/2 of the credit is still out: more answers may come"
    tracker.deliver("second answer", Fraction(1, 2))
    waiter.join(10)
    assert got == [["first answer", "second answer"]], "both, in one batch"
    # the batch's credit is now the caller's: handed back, the pass is over
    tracker.returned(Fraction(3, 4), {1, 2}, None)
    assert tracker.next_work() is None and tracker.done
