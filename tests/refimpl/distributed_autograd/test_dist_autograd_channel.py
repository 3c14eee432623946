"""The direct gradient channel (channel.py): calls, answers, failures. No RPC agent:
two channels in one process find each other through a stand-in for the RPC address lookup."""

from __future__ import annotations

import socket
import threading
import time
import warnings

import pytest
import torch

from refimpl.distributed_autograd import channel as channel_mod
from refimpl.distributed_autograd import handlers, handshake
from refimpl.distributed_autograd.channel import Channel
from refimpl.distributed_autograd.connection import Connection


# calls ---------------------------------------------------------------------------------------------
def _done(value) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


@pytest.fixture
def pair(monkeypatch):
    """Two channels (workers 0 and 1) in this process, over loopback."""
    monkeypatch.setenv("TP_SOCKET_IFNAME", "lo")
    monkeypatch.setattr(channel_mod.rpc, "get_rpc_timeout", lambda: 60.0)
    channels: dict[int, Channel] = {}
    for me in (0, 1):
        channels[me] = Channel(me, lambda dst: _done(channels[dst].address()))
    yield channels
    for ch in channels.values():
        ch.close()


def _call(channel: Channel, dst: int, fn, args, on_done) -> None:
    """``channel.call``, once the connection to ``dst`` is open (the first calls find none)."""
    deadline = time.monotonic() + 30
    while not channel.call(dst, fn, args, on_done):
        assert time.monotonic() < deadline, "the connection never opened"
        time.sleep(0.01)


class _Answers:
    def __init__(self) -> None:
        self.got: list = []
        self.done = threading.Event()

    def __call__(self, answer, error) -> None:
        self.got.append((answer, error))
        self.done.set()

    def wait(self):
        assert self.done.wait(30), "no answer"
        return self.got[0]


def _count_writes(monkeypatch) -> list:
    """The peers of the frames written from now on, in order, on open connections (a late
    answer of an earlier test's closed pair does not count)."""
    written: list = []
    write = Connection.write

    def counting_write(self, frame):
        if self.closed is None:
            written.append(self.peer)
        return write(self, frame)

    monkeypatch.setattr(Connection, "write", counting_write)
    return written


def _scale(t: torch.Tensor, k: float) -> torch.Tensor:
    return t * k


def _fail(message: str) -> None:
    raise ValueError(message)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_call_runs_on_the_peer_and_its_answer_comes_back(pair):
    answers = _Answers()
    _call(pair[0], 1, _scale, (torch.ones(3), 2.0), answers)
    answer, error = answers.wait()
    assert error is None and torch.equal(answer, torch.full((3,), 2.0))
    assert pair[0].calls_sent == 1


def test_calls_are_answered_in_both_directions_on_separate_connections(pair):
    a, b = _Answers(), _Answers()
    _call(pair[0], 1, _scale, (torch.ones(1), 3.0), a)
    _call(pair[1], 0, _scale, (torch.ones(1), 5.0), b)
    assert a.wait()[0].item() == 3.0 and b.wait()[0].item() == 5.0


_RAN: list = []
_RAN_EVENT = threading.Event()


def _record(value) -> None:
    _RAN.append(value)
    _RAN_EVENT.set()


def test_a_call_without_a_callback_runs_and_nothing_comes_back(pair, monkeypatch):
    """messaging.py [Note: answers nobody needs]: the peer runs it and writes nothing back; the
    sender keeps no record of it."""
    written = _count_writes(monkeypatch)
    _RAN.clear()
    _RAN_EVENT.clear()
    first = _Answers()
    _call(pair[0], 1, _scale, (torch.ones(1), 1.0), first)  # opens the connection
    first.wait()
    assert pair[0].call(1, _record, ("no answer",), None)
    assert _RAN_EVENT.wait(30) and _RAN == ["no answer"]
    assert not pair[0]._calls and pair[0].calls_sent == 2
    later = _Answers()
    _call(pair[0], 1, _scale, (torch.ones(1), 5.0), later)
    assert later.wait()[0].item() == 5.0
    time.sleep(0.2)
    # worker 1 wrote two answers (to worker 0): none for the call that asked for none
    assert written.count(0) == 2 and written.count(1) == 3 and len(later.got) == 1


def test_a_failing_call_without_a_callback_is_a_warning_on_the_peer(pair):
    first = _Answers()
    _call(pair[0], 1, _scale, (torch.ones(1), 1.0), first)
    first.wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pair[0].call(1, _fail, ("nobody to tell",), None)
        deadline = time.monotonic() + 30
        while not any("nobody to tell" in str(w.message) for w in caught):
            assert time.monotonic() < deadline, "no warning"
            time.sleep(0.01)
    assert "channel call failed" in str(caught[-1].message)


def test_an_exception_in_the_call_comes_back_as_its_error(pair):
    answers = _Answers()
    _call(pair[0], 1, _fail, ("no such send edge",), answers)
    assert answers.wait() == (None, "no such send edge")


def test_a_connection_without_the_token_is_closed_unread(pair):
    host, port, token = pair[1].address()
    with socket.create_connection((host, port)) as sock:
        assert handshake.read_exactly(sock, 24) == handshake.greeting(token)  # it speaks first
        sock.sendall(b"\0" * 20)
        sock.settimeout(30)
        assert sock.recv(1) == b"", "the listener must close a connection with a wrong token"


def test_unanswered_calls_fail_when_the_peer_closes(pair):
    answers = _Answers()
    _call(pair[0], 1, _sleep, (5.0,), answers)
    time.sleep(0.2)
    pair[1].close()
    answer, error = answers.wait()
    assert answer is None and "connection to worker 1 lost" in error


def test_a_call_unanswered_past_the_rpc_timeout_fails(pair, monkeypatch):
    monkeypatch.setattr(channel_mod.rpc, "get_rpc_timeout", lambda: 0.2)
    answers = _Answers()
    _call(pair[0], 1, _sleep, (5.0,), answers)
    answer, error = answers.wait()
    assert answer is None and "RPC ran for more than set timeout" in error


def test_a_closed_channel_refuses_calls_and_fails_those_in_flight(pair):
    answers = _Answers()
    _call(pair[0], 1, _sleep, (5.0,), answers)
    pair[0].close()
    assert "closed" in answers.wait()[1]
    assert not pair[0].call(1, _scale, (torch.ones(1), 1.0), _Answers()), "sent on a closed one"


# switch ----------------------------------------------------------------------------------------
def test_the_channel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(channel_mod.ENV, "rpc")
    assert not channel_mod.enabled()
    monkeypatch.setenv(channel_mod.ENV, "socket")
    assert channel_mod.enabled()


def _unpicklable():
    return threading.Lock()


def test_an_answer_that_cannot_be_pickled_comes_back_as_an_error(pair):
    answers = _Answers()
    _call(pair[0], 1, _unpicklable, (), answers)
    answer, error = answers.wait()
    assert answer is None and "could not be sent back" in error


def test_a_failing_callback_does_not_stop_the_answers(pair):
    def explode(answer, error):
        raise RuntimeError("callback bug")

    with pytest.warns(UserWarning, match="callback failed"):
        _call(pair[0], 1, _scale, (torch.ones(1), 1.0), explode)
        later = _Answers()
        _call(pair[0], 1, _scale, (torch.ones(1), 4.0), later)
        assert later.wait()[0].item() == 4.0


def test_the_first_call_finds_no_connection_and_sends_nothing(pair):
    answers = _Answers()
    assert not pair[0].call(1, _scale, (torch.ones(1), 1.0), answers)
    assert pair[0].calls_sent == 0 and not answers.got
    _call(pair[0], 1, _scale, (torch.ones(1), 2.0), answers)
    assert answers.wait()[0].item() == 2.0


def test_a_peer_whose_address_cannot_be_had_is_remembered_as_unreachable():
    def refuse(dst):
        fut = torch.futures.Future()
        fut.set_exception(RuntimeError("its channel is switched off"))
        return fut

    channel = Channel(0, refuse)
    with pytest.warns(UserWarning, match="no direct channel to worker 1 .its channel is switched"):
        assert not channel.call(1, _scale, (torch.ones(1), 1.0), _Answers())
        deadline = time.monotonic() + 30  # the connecting thread finds out
        while not channel.unreachable:
            assert time.monotonic() < deadline, "the peer was never marked unreachable"
            time.sleep(0.01)
    assert channel.unreachable == {1: "its channel is switched off"}
    assert not channel.call(1, _scale, (torch.ones(1), 1.0), _Answers())
    channel.close()


def test_a_channel_whose_agent_is_gone_answers_with_an_error(monkeypatch):
    monkeypatch.setenv("TP_SOCKET_IFNAME", "lo")
    monkeypatch.setattr(channel_mod.rpc, "get_rpc_timeout", lambda: 60.0)
    channels = {0: Channel(0, lambda dst: _done(channels[dst].address()))}
    channels[1] = Channel(1, lambda dst: _done(channels[dst].address()), is_current=lambda: False)
    answers = _Answers()
    _call(channels[0], 1, _scale, (torch.ones(1), 2.0), answers)
    assert answers.wait() == (None, "the worker's RPC agent that this channel served is gone")
    for ch in channels.values():
        ch.close()


def test_an_rpc_timeout_of_zero_means_no_timeout(pair, monkeypatch):
    monkeypatch.setattr(channel_mod.rpc, "get_rpc_timeout", lambda: 0.0)
    answers = _Answers()
    _call(pair[0], 1, _sleep, (1.5,), answers)
    assert answers.wait() == (None, None)


def test_closing_without_failing_drops_the_calls_in_flight(pair):
    answers = _Answers()
    _call(pair[0], 1, _sleep, (5.0,), answers)
    pair[0].close(fail_calls=False)
    time.sleep(0.5)
    assert not answers.got


def test_a_timed_out_connection_stops_taking_calls_and_fails_none_of_the_next(pair, monkeypatch):
    timeouts = iter([0.5])
    monkeypatch.setattr(channel_mod.rpc, "get_rpc_timeout", lambda: next(timeouts, 60.0))
    slow, fast = _Answers(), _Answers()
    _call(pair[0], 1, _sleep, (2.5,), slow)
    assert "RPC ran for more than set timeout" in slow.wait()[1]
    _call(pair[0], 1, _scale, (torch.ones(1), 3.0), fast)  # on a new connection
    answer, error = fast.wait()
    assert error is None and answer.item() == 3.0
    time.sleep(3.0)  # the slow call's late answer arrives and retires the old connection
    assert slow.got == [slow.got[0]] and fast.got == [fast.got[0]], "a callback ran twice"


def test_a_call_after_close_is_refused_and_never_called_back(pair):
    answers = _Answers()
    _call(pair[0], 1, _scale, (torch.ones(1), 1.0), answers)
    answers.wait()
    pair[0].close(fail_calls=False)
    late = _Answers()
    assert not pair[0].call(1, _scale, (torch.ones(1), 1.0), late)
    time.sleep(0.3)
    assert not late.got


# [Note: an answer that rides along] ---------------------------------------------------------------
_PAIR: dict = {}


def _send_back(value) -> None:
    """On worker 1: send ``value`` to the caller (worker 0), asking no answer, then answer
    nothing."""
    assert _PAIR[1].call(0, _record, (value,), None), "no connection back to worker 0"


@handlers.defers_empty_answer
def _forward_back(value) -> None:
    _send_back(value)


@pytest.mark.parametrize("forwarding", [True, False], ids=["declared", "not-declared"])
def test_an_empty_answer_rides_in_a_message_back_to_the_caller(pair, monkeypatch, forwarding):
    """A handler declared ``defers_empty_answer`` that sends to its caller answers in that
    message: the caller's call is answered, empty, and no answer frame of its own is written;
    a handler not declared so gets its answer frame as before."""
    _PAIR.clear()
    _PAIR.update(pair)
    for src, dst in ((1, 0), (0, 1)):  # open both connections
        opened = _Answers()
        _call(pair[src], dst, _scale, (torch.ones(1), 1.0), opened)
        opened.wait()
    written = _count_writes(monkeypatch)
    _RAN.clear()
    _RAN_EVENT.clear()
    answers = _Answers()
    handler = _forward_back if forwarding else _send_back
    _call(pair[0], 1, handler, (7,), answers)
    assert answers.wait() == (None, None)
    assert _RAN_EVENT.wait(30) and _RAN == [7]
    time.sleep(0.3)  # an answer frame, if any, is written by now
    # worker 0's call to 1, worker 1's message back to 0, and (not declared) 1's answer to 0
    assert written == ([1, 0] if forwarding else [1, 0, 0])
    assert answers.got == [(None, None)], "answered once"


# owed.py [Note: answers that wait] ----------------------------------------------------------------
@handlers.defers_empty_answer
def _run_quietly(value) -> None:
    """A deferring handler that sends its caller nothing: its empty answer is held."""
    _record(value)


def _open_both(pair) -> None:
    _PAIR.clear()
    _PAIR.update(pair)
    for src, dst in ((1, 0), (0, 1)):
        opened = _Answers()
        _call(pair[src], dst, _scale, (torch.ones(1), 1.0), opened)
        opened.wait()


def test_a_held_answer_rides_in_the_next_frame_to_the_caller(pair, monkeypatch):
    """The empty answer of a deferring handler is not written when the handler returns; the
    receiver's next frame to the caller carries it, and no answer frame is ever written."""
    monkeypatch.setattr("refimpl.distributed_autograd.owed._FLUSH_AFTER", 30.0)
    _open_both(pair)
    written = _count_writes(monkeypatch)
    _RAN.clear()
    _RAN_EVENT.clear()
    answers = _Answers()
    _call(pair[0], 1, _run_quietly, (1,), answers)
    assert _RAN_EVENT.wait(30) and _RAN == [1]
    time.sleep(0.3)
    assert not answers.got, "the empty answer was written at once"
    assert pair[0]._calls, "the caller forgot its call before any answer"
    _RAN_EVENT.clear()
    assert pair[1].call(0, _record, (2,), None)  # worker 1's next frame to worker 0
    assert answers.wait() == (None, None)
    assert _RAN_EVENT.wait(30) and _RAN == [1, 2]
    time.sleep(0.3)
    assert written == [1, 0], "an answer frame was written besides the two calls"
    assert answers.got == [(None, None)] and not pair[0]._calls


def test_a_held_answer_is_written_after_a_while_or_on_close(pair, monkeypatch):
    """With no frame to ride in, a held answer is written on its own within ``flush_after`` (a
    quarter of a short RPC timeout, so the call never times out); a closing channel writes the
    ones it still holds before closing."""
    monkeypatch.setattr(channel_mod.rpc, "get_rpc_timeout", lambda: 0.4)  # 0.1 s at most
    _open_both(pair)
    answers = [_Answers() for _ in range(3)]
    for k, answer in enumerate(answers):
        _call(pair[0], 1, _run_quietly, (k,), answer)
    for answer in answers:
        assert answer.wait() == (None, None), "a held answer made its call fail"
        assert answer.got == [(None, None)]
    monkeypatch.setattr("refimpl.distributed_autograd.owed._FLUSH_AFTER", 30.0)
    monkeypatch.setattr(channel_mod.rpc, "get_rpc_timeout", lambda: 600.0)
    time.sleep(1.5)  # the watch thread now waits 30 s between writes
    late = _Answers()
    _call(pair[0], 1, _run_quietly, ("held",), late)
    time.sleep(0.3)
    assert not late.got
    pair[1].close()
    assert late.wait() == (None, None), "the answer was lost when the channel closed"


# handlers by name (handlers.py) ------------------------------------------------------------------------
@handlers.handler
def _named_scale(t: torch.Tensor, k: float) -> torch.Tensor:
    return t * k


def test_a_registered_handler_travels_by_name_and_an_unknown_name_is_an_error(pair, monkeypatch):
    from refimpl.distributed_autograd import frames

    names = []
    encode = frames.encode

    def spying_encode(obj, tail=None):
        if len(obj) == 5:
            names.append(obj[1])
        return encode(obj, tail)

    monkeypatch.setattr(channel_mod, "encode", spying_encode)
    answers = _Answers()
    _call(pair[0], 1, _named_scale, (torch.ones(2), 4.0), answers)
    answer, error = answers.wait()
    assert error is None and torch.equal(answer, torch.full((2,), 4.0))
    assert names[-1] == f"{__name__}._named_scale", "sent by name, not pickled"
    monkeypatch.delitem(handlers.BY_NAME, f"{__name__}._named_scale")  # gone on the peer
    unknown = _Answers()
    _call(pair[0], 1, _named_scale, (torch.ones(2), 4.0), unknown)
    assert "no channel handler" in unknown.wait()[1]
