"""Empty answers a channel holds back (owed.py): held per caller, taken to ride in a frame,
written when due, never later than a quarter of the RPC timeout."""

from __future__ import annotations

import math
import socket
import time

from refimpl.distributed_autograd.connection import Connection
from refimpl.distributed_autograd.frames import decode
from refimpl.distributed_autograd.owed import OwedAnswers, flush_after


def test_an_answer_waits_100ms_or_a_quarter_of_a_shorter_rpc_timeout():
    assert flush_after(60.0) == 0.1
    assert flush_after(0.04) == 0.01
    assert flush_after(0) == 0.1  # 0: no RPC timeout


def test_answers_are_held_per_caller_and_taken_once():
    owed = OwedAnswers()
    assert not owed and owed.take(1) == []
    owed.hold(1, 10, "c1")
    assert owed, "an answer is held"
    owed.hold(1, 11, "c1")
    owed.hold(2, 20, "c2")
    assert [seq for seq, _, _ in owed.take(1)] == [10, 11]
    assert owed.take(1) == []
    taken = owed.take(2)
    assert [seq for seq, _, _ in taken] == [20] and not owed
    owed.hold(2, 21, "c2")
    owed.put_back(2, taken)  # the frame that was to carry it was not written
    assert [seq for seq, _, _ in owed.take(2)] == [20, 21], "put back ahead, in order"


def test_due_takes_only_answers_held_before_the_time_grouped_by_connection():
    owed = OwedAnswers()
    owed.hold(1, 10, "a")
    time.sleep(0.002)
    owed.hold(1, 11, "b")
    cut = owed.last_held
    time.sleep(0.002)
    owed.hold(1, 12, "a")
    owed.hold(2, 20, "a")
    assert owed.due(cut) == [("a", [10])], "only what was held before the cut"
    assert sorted(owed.due(math.inf)) == [("a", [12, 20]), ("b", [11])]
    assert not owed


def test_write_due_writes_empty_answers_the_caller_reads_as_answers():
    a, b = socket.socketpair()
    try:
        conn = Connection(a, peer=1)
        owed = OwedAnswers()
        for seq in (5, 6):
            owed.hold(1, seq, conn)
        owed.write_due(math.inf)
        rfile = b.makefile("rb")
        assert [decode(rfile) for _ in range(2)] == [(5, None, None), (6, None, None)]
        conn.close("done")
        owed.hold(1, 7, conn)
        owed.write_due(math.inf)  # a closed connection: nothing raised, nothing kept
        assert not owed
    finally:
        b.close()
