"""Credit recovery: the root knows a backward pass is over (credit.py [Note: credit])."""

from __future__ import annotations

import pickle
import threading
from fractions import Fraction

import pytest

from refimpl.distributed_autograd.credit import (
    FULL,
    NONE,
    PassRegistry,
    PassTracker,
    add,
    is_full,
    split,
)


def _c(fraction: Fraction) -> tuple[int, int]:
    return fraction.numerator, fraction.denominator


def test_the_pass_is_over_only_when_all_credit_is_back_in_any_order():
    tracker = PassTracker(me=0)
    # the root split 1 between two messages; the second branch split again at worker 2
    shares = [(1, 2), (1, 4), (1, 4)]
    for credit, worker in zip(reversed(shares), (3, 2, 1), strict=True):
        assert not tracker.done
        tracker.returned(credit, {worker}, None)
    assert tracker.done
    assert tracker.reached == {0, 1, 2, 3} and tracker.error is None


def test_the_first_error_is_kept_and_double_counted_credit_still_ends_the_pass():
    tracker = PassTracker(me=0)
    tracker.returned((1, 2), {1}, (1, "boom"))
    tracker.returned((1, 2), {2}, (2, "later"))
    tracker.returned((1, 2), {2}, None)  # reported by the sender and downstream too
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


def test_credit_is_two_ints_in_lowest_terms_and_exact_like_fractions():
    # splits and sums of every shape a pass makes (fan-outs of 1..7, merges), against Fraction
    for parts in range(1, 8):
        share = split(FULL, parts)
        assert share == _c(Fraction(1, parts)) and all(type(v) is int for v in share)
        again = split(share, 3)
        assert again == _c(Fraction(1, parts * 3))
        total = NONE
        for _ in range(parts * 3):
            total = add(total, again)
        assert total == FULL and is_full(total)
    assert add((1, 6), (1, 3)) == (1, 2) and add(NONE, (2, 3)) == (2, 3)
    assert not is_full((5, 6)) and is_full((7, 6))  # over 1: credit counted twice on an error
    assert pickle.loads(pickle.dumps((1, 12))) == (1, 12)


@pytest.mark.parametrize("parts", [3, 7])
def test_a_third_split_three_ways_again_and_again_still_sums_to_one(parts):
    shares, total = [FULL], NONE
    for _ in range(4):  # a tree of fan-outs: every share split again
        shares = [split(share, parts) for share in shares for _ in range(parts)]
    for share in shares:
        total = add(total, share)
    assert total == FULL


def test_the_roots_own_messages_wait_until_they_hold_all_outstanding_credit():
    tracker = PassTracker(me=0)
    tracker.deliver("first answer", (1, 4))
    tracker.returned((1, 4), {3}, None)  # a branch ended at leaves elsewhere
    got = []
    waiter = threading.Thread(target=lambda: got.append(tracker.next_work()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "1/2 of the credit is still out: more answers may come"
    tracker.deliver("second answer", (1, 2))
    waiter.join(10)
    assert got == [["first answer", "second answer"]], "both, in one batch"
    # the batch's credit is now the caller's: handed back, the pass is over
    tracker.returned((3, 4), {1, 2}, None)
    assert tracker.next_work() is None and tracker.done
