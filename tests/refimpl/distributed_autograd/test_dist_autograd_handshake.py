"""How a channel connection starts (handshake.py): the listener greets first, and a connector
writes nothing to a listener that does not greet as the channel it was told of."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from refimpl.distributed_autograd import channel as channel_mod
from refimpl.distributed_autograd import handshake
from refimpl.distributed_autograd.channel import Channel


class _Silent:
    """A listener of another protocol (TensorPipe's, gloo's): it waits for the connector's
    first bytes and records them."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.got: list[bytes] = []
        self.done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        conn.settimeout(1.0)
        try:
            self.got.append(conn.recv(64))
        except OSError:
            self.got.append(b"")
        conn.close()
        self.done.set()


def test_a_connector_writes_nothing_to_a_listener_that_does_not_greet(monkeypatch):
    """The address a channel was given went stale and another protocol's listener took the
    port: it must read nothing (TensorPipe reads 8 bytes as a length and aborts on it)."""
    monkeypatch.setattr(channel_mod.rpc, "get_rpc_timeout", lambda: 60.0)
    silent = _Silent()

    def stale(dst):
        fut = torch.futures.Future()
        fut.set_result(("127.0.0.1", silent.port, b"\x07" * handshake.TOKEN_BYTES))
        return fut

    channel = Channel(0, stale)
    with pytest.warns(UserWarning, match="did not answer as the channel"):
        assert not channel.call(1, print, (), None)
        assert silent.done.wait(30)
        deadline = time.monotonic() + 30
        while not channel.unreachable:
            assert time.monotonic() < deadline, "the connector never gave up"
            time.sleep(0.01)
    assert silent.got == [b""], f"the connector wrote {silent.got[0]!r} to a foreign listener"
    channel.close()


def test_the_greeting_names_one_channel_without_showing_its_token():
    token, other = b"\x01" * 16, b"\x02" * 16
    assert handshake.greeting(token).startswith(handshake.MAGIC)
    assert handshake.greeting(token) != handshake.greeting(other)
    assert token not in handshake.greeting(token)


def test_a_connector_checks_the_greeting_then_says_hello():
    a, b = socket.socketpair()
    token = b"\x05" * 16
    peer: list = []
    listener = threading.Thread(target=lambda: peer.append(handshake.accept(b, token)))
    listener.start()
    assert handshake.read_exactly(a, 24) == handshake.greeting(token)
    a.sendall(token + (3).to_bytes(4, "big"))
    listener.join(10)
    assert peer == [3]
    a.close()
    b.close()
