"""One TCP connection of the gradient channel (channel.py): ordered writes that never block,
a socket closed by the last thread that uses it; the address the channel listens on
(``listen_address``: where TensorPipe listens).

[Note: a write never blocks its thread]
A channel's handlers forward gradients, so a thread that reads from one connection writes to
another. ``Connection.write`` writes what the socket takes at once (``MSG_DONTWAIT``) and leaves
the rest, copied, to the connection's writer thread, started on the first write that needs it;
frames behind a pending one queue after it, so the peer reads them in order. Two handlers
writing to each other over full connections therefore cannot deadlock. Since a frame may borrow
a tensor's bytes (frames.py [Note: frames borrow]), nothing of it is read after ``write``
returns: what is left is a copy.

A closed connection (by either side, or by a failed write) refuses writes with its cause.

[Note: a descriptor outlives its users]
Closing a connection from any thread shuts its socket down, which ends a read or a write
blocked on it; the file descriptor itself is closed by the last thread that uses it outside
the connection's lock: the thread that reads (``reading()``) and the writer thread, each when it
stops. Closed under a user's feet, its number can be handed to a new socket (one of
TensorPipe's, gloo's, or another connection's) before the user's next system call, which then
reads that socket's bytes or writes a frame into it. Python's socket object does not guard
this: a thread that has released the GIL to send has already read the number. A frame written
into a TensorPipe or gloo connection is read there as a length, and allocating it aborts the
process (``std::bad_alloc``). ``socket.makefile``, used before, kept the descriptor open for its
reader the same way; the writer thread closed nothing and wrote on a descriptor the reader
could close.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import socket
import struct
import threading
from collections import deque


def listen_address() -> str:
    """Where TensorPipe listens: ``TP_SOCKET_IFNAME``'s IPv4 address, else the host name's."""
    ifname = os.environ.get("TP_SOCKET_IFNAME")
    if ifname:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
            except OSError as exc:
                raise RuntimeError(
                    f"TP_SOCKET_IFNAME={ifname!r} names no interface with an IPv4 address ({exc})"
                ) from exc
        return socket.inet_ntoa(packed[20:24])
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class _SocketReader(io.RawIOBase):
    """A socket as the raw stream of a ``BufferedReader``: its ``readinto`` is the socket's own
    ``recv_into`` (C). ``socket.makefile`` puts a Python ``SocketIO`` there, whose ``readinto``
    costs two Python frames per read, on a thread that just woke up to read a message."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.readinto = sock.recv_into  # blocking; an interrupted read is retried (PEP 475)

    def readable(self) -> bool:
        return True


def _advance(pieces: list, sent: int) -> list:
    """The pieces still to write after ``sent`` bytes of them were written."""
    while pieces and sent >= pieces[0].nbytes:
        sent -= pieces[0].nbytes
        pieces = pieces[1:]
    if sent:
        pieces = [pieces[0][sent:], *pieces[1:]]
    return pieces


class Connection:
    """A TCP connection whose writes are ordered and never block the writing thread."""

    def __init__(self, sock: socket.socket, peer: int) -> None:
        self.sock = sock
        self.peer = peer
        self.rfile = io.BufferedReader(_SocketReader(sock), buffer_size=1 << 16)
        self.closed: str | None = None  # why, once closed
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._pending: deque = deque()  # frames' bytes not yet written (copies), in order
        self._writer: threading.Thread | None = None
        # threads that use the socket outside the lock: the last one to stop closes it
        # ([Note: a descriptor outlives its users])
        self._reading = False
        self._writing = False

    @contextlib.contextmanager
    def reading(self, why: str = "its reader stopped"):
        """``with conn.reading():`` around a thread's reads of ``rfile``; on leaving, the
        connection is closed (``why``, unless it was already), and its socket with it unless
        the writer thread still runs ([Note: a descriptor outlives its users])."""
        with self._lock:
            if self.closed is None:
                self._reading = True
        try:
            yield self.rfile
        finally:
            with self._lock:
                self._reading = False
                self._close_locked(why)

    def write(self, frame: tuple[list, list]) -> None:
        """Write ``frame`` now as far as the socket takes it; the rest is copied and left to the
        writer thread. A frame may borrow a tensor's bytes (frames.py [Note: frames borrow]):
        nothing of it is read after this returns."""
        pieces, _borrowed = frame
        with self._lock:
            if self.closed is not None:
                raise ConnectionError(f"connection to worker {self.peer} is closed: {self.closed}")
            if not self._pending:
                try:
                    while pieces:
                        pieces = _advance(
                            pieces, self.sock.sendmsg(pieces, [], socket.MSG_DONTWAIT)
                        )
                except BlockingIOError:
                    pass
                except OSError as exc:
                    self._close_locked(f"{exc}")
                    raise ConnectionError(f"sending to worker {self.peer} failed: {exc}") from exc
                if not pieces:
                    return
            self._pending.append([memoryview(bytes(piece)) for piece in pieces])
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_pending,
                    name=f"refimpl-channel-writer-{self.peer}",
                    daemon=True,
                )
                self._writing = True
                self._writer.start()
            self._ready.notify()

    def _write_pending(self) -> None:
        """The writer thread: writes what ``write`` left, in order, until the connection
        closes; then closes the socket if the reader has stopped ([Note: a descriptor outlives
        its users])."""
        try:
            self._write_until_closed()
        finally:
            with self._lock:
                self._writing = False
                self._close_locked("its writer stopped")

    def _write_until_closed(self) -> None:
        while True:
            with self._lock:
                while not self._pending and self.closed is None:
                    self._ready.wait()
                if self.closed is not None:
                    return
                pieces = self._pending[0]
            try:
                while pieces:
                    pieces = _advance(pieces, self.sock.sendmsg(pieces))
            except OSError as exc:
                self.close(f"{exc}")
                return
            with self._lock:
                if self.closed is not None:  # close() cleared the queue meanwhile
                    return
                self._pending.popleft()

    def close(self, why: str) -> None:
        with self._lock:
            self._close_locked(why)

    def _close_locked(self, why: str) -> None:
        """Close (caller holds the lock); the socket itself once no thread uses it ([Note: a
        descriptor outlives its users]). Called again by each user as it stops."""
        if self.closed is None:
            self.closed = why
            self._pending.clear()
            self._ready.notify_all()
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # ends a read or write blocked on it
            except OSError:
                pass
        if not self._reading and not self._writing:
            self.sock.close()  # (closing twice is harmless)
