"""One connection of the gradient channel (connection.py): ordered writes that never block,
what a borrowed frame leaves behind, and where the channel listens."""

from __future__ import annotations

import io
import socket
import threading

import pytest
import torch

from refimpl.distributed_autograd.connection import Connection, listen_address
from refimpl.distributed_autograd.frames import decode, encode


def test_a_write_to_a_full_connection_returns_and_the_writer_finishes_it_in_order():
    a, b = socket.socketpair()
    conn = Connection(a, peer=1)
    chunks = [bytes([i]) * (1 << 20) for i in range(8)]  # 8 MiB: far over the socket buffers
    writing = threading.Thread(
        target=lambda: [conn.write(([memoryview(c)], [])) for c in chunks], daemon=True
    )
    writing.start()
    writing.join(30)
    assert not writing.is_alive(), "write blocked on a peer that does not read"
    received = bytearray()
    while len(received) < 8 << 20:
        received += b.recv(1 << 20)
    assert bytes(received) == b"".join(chunks)
    conn.close("test over")
    b.close()


def test_what_a_full_connection_leaves_to_its_writer_is_a_copy():
    """A frame may borrow a tensor's memory (frames.py [Note: frames borrow]): what the socket
    did not take is copied before write returns, so a later in-place change is not sent."""
    a, b = socket.socketpair()
    conn = Connection(a, peer=1)
    filler = b"\0" * (8 << 20)  # far over the socket buffers: what follows waits its turn
    t = torch.arange(1024, dtype=torch.float32)
    writing = threading.Thread(
        target=lambda: [conn.write(([memoryview(filler)], [])), conn.write(encode([t]))],
        daemon=True,
    )
    writing.start()
    writing.join(30)
    assert not writing.is_alive(), "write blocked on a peer that does not read"
    t.fill_(-1.0)  # after write returned, before the writer thread sent it
    received = bytearray()
    while len(received) < len(filler):
        received += b.recv(1 << 20)
    b.settimeout(30)
    rest = bytes(received[len(filler) :])
    while True:
        try:
            got = decode(io.BytesIO(rest))
            break
        except ConnectionError:  # not all of it yet
            rest += b.recv(1 << 20)
    assert torch.equal(got[0], torch.arange(1024, dtype=torch.float32))
    conn.close("test over")
    b.close()


def test_a_closed_connection_refuses_writes_with_its_cause():
    a, b = socket.socketpair()
    conn = Connection(a, peer=3)
    conn.close("peer went away")
    with pytest.raises(ConnectionError, match="worker 3 is closed: peer went away"):
        conn.write(([memoryview(b"x")], []))
    b.close()


def test_the_channel_listens_on_the_tensorpipe_interface(monkeypatch):
    monkeypatch.setenv("TP_SOCKET_IFNAME", "lo")
    assert listen_address() == "127.0.0.1"
    monkeypatch.setenv("TP_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(RuntimeError, match="TP_SOCKET_IFNAME='no-such-if0' names no interface"):
        listen_address()


def test_a_connection_reads_frames_through_the_sockets_recv_into_and_sees_the_end():
    """The read side: a buffered reader whose raw reads are the socket's own ``recv_into`` (no
    Python frame per read); it reads a frame split across writes, and a peer that leaves ends
    the stream (the channel's reader threads stop on it)."""
    a, b = socket.socketpair()
    conn = Connection(a, peer=1)
    assert conn.rfile.raw.readinto == a.recv_into
    pieces, _ = encode(("ping", 3), [torch.arange(5.0)])
    data = b"".join(bytes(p) for p in pieces)
    b.sendall(data[:7])  # part of the header first: the reader waits for the rest
    later = threading.Timer(0.05, lambda: b.sendall(data[7:]))
    later.start()
    tail: list = []
    assert decode(conn.rfile, tail) == ("ping", 3) and torch.equal(tail[0], torch.arange(5.0))
    later.join()
    b.close()
    with pytest.raises(ConnectionError, match="closed by peer"):
        decode(conn.rfile)
    conn.close("test over")


def test_closing_under_a_reader_leaves_the_socket_to_the_reader():
    """connection.py [Note: a descriptor outlives its users]: a close from another thread ends a
    blocked read but leaves the file descriptor to the reading thread (a number closed under
    it could be reused by a new socket before its next read); the reader closes it on
    leaving. Without a reader, close closes the socket at once."""
    a, b = socket.socketpair()
    conn = Connection(a, peer=1)
    seen = []

    def read():
        with conn.reading() as rfile:
            seen.append(rfile.read(1))
            while not seen[-1] == b"":
                seen.append(rfile.read(1))
            seen.append(a.fileno())  # closed under the reader: the descriptor is still open

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    b.sendall(b"x")
    while not seen:
        threading.Event().wait(0.01)
    conn.close("closed by another thread")
    reader.join(10)
    assert not reader.is_alive(), "the close did not end the blocked read"
    assert seen[0] == b"x" and seen[-2] == b"" and seen[-1] >= 0
    assert a.fileno() == -1 and conn.closed == "closed by another thread"
    c, d = socket.socketpair()
    Connection(c, peer=2).close("no reader")
    assert c.fileno() == -1
    b.close()
    d.close()


class _HeldSocket:
    """A socket whose blocking ``sendmsg`` (the writer thread's) waits until released."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.sending = threading.Event()
        self.release = threading.Event()

    def sendmsg(self, pieces, *args):
        if not args:  # the writer thread's call (``write`` sends with MSG_DONTWAIT)
            self.sending.set()
            self.release.wait(10)
        return self._sock.sendmsg(pieces, *args)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_the_descriptor_stays_open_while_the_writer_thread_may_still_send():
    """connection.py [Note: a descriptor outlives its users]: when the reader stops while the
    writer thread is about to send, the descriptor must stay open until the writer stops (its
    number, freed, could be a TensorPipe socket by the time the send happens)."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    held = _HeldSocket(a)
    conn = Connection(a, peer=1)
    conn.sock = held
    done = threading.Event()

    def read():
        with conn.reading() as rfile:
            while rfile.read(1):
                pass
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    conn.write(([memoryview(b"\x01" * (1 << 20))], []))  # more than the socket takes at once
    assert held.sending.wait(10), "the writer thread never started"
    b.shutdown(socket.SHUT_WR)  # the peer leaves: the reader sees the end and stops
    assert done.wait(10)
    assert a.fileno() != -1, "the reader closed the descriptor the writer thread is about to use"
    held.release.set()
    conn._writer.join(10)
    assert a.fileno() == -1, "the last user (the writer) must close it"
    b.close()
