"""How a connection of the gradient channel starts (channel.py): the listener speaks first.

[Note: nothing is written to a listener that did not say who it is]
The connecting worker learns its peer's address and token over RPC, then connects. Between the
two, the address can go stale: the peer's channel closed (its RPC agent was shut down, its
process ended) and the port was taken by another listener — TensorPipe's, gloo's, another
process's. A connector that spoke first then wrote its token into that listener's stream,
where TensorPipe and gloo read the first 8 bytes as a length and allocate it: 16 random bytes
make a length of exabytes and the process aborts with ``std::bad_alloc`` (the same as any
channel bytes written into a foreign stream: connection.py [Note: a descriptor outlives its
users]).

So the listener speaks first: on accepting, it writes a greeting, the channel's magic and a
digest of its token (:func:`greeting`; the digest shows which channel answers without
showing the token). The connector writes nothing until it has read that exact greeting, within
``TIMEOUT_S``: a foreign listener waits for its own protocol's first message (TensorPipe's and
gloo's listeners do), and the connector gives up without having written a byte. Only then
does it send the token and its worker id (the hello), which the listener checks in turn.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

MAGIC = b"refimplC"  # the greeting's first bytes: "a refimpl channel listens here"
TOKEN_BYTES = 16
_DIGEST_BYTES = 16
_GREETING_BYTES = len(MAGIC) + _DIGEST_BYTES
_HELLO = struct.Struct("!I")  # the connector's worker id, after the token
TIMEOUT_S = 30.0  # how long either side waits for the other's first bytes


def greeting(token: bytes) -> bytes:
    """What the listener of the channel whose token is ``token`` writes first."""
    return MAGIC + hashlib.sha256(MAGIC + token).digest()[:_DIGEST_BYTES]


def read_exactly(sock: socket.socket, size: int, timeout: float = TIMEOUT_S) -> bytes | None:
    """The next ``size`` bytes of ``sock``, within ``timeout`` s; ``None`` when they do not
    come (the other side closed, or is silent)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while len(got) < size:
            chunk = sock.recv(size - len(got))
            if not chunk:
                return None
            got += chunk
    except OSError:
        return None
    sock.settimeout(None)
    return got


def accept(sock: socket.socket, token: bytes) -> int | None:
    """Listener side, on a new connection: greet, then read and check the hello. The worker id
    of the connector, or ``None`` (then close the socket unread)."""
    try:
        sock.sendall(greeting(token))
    except OSError:
        return None
    hello = read_exactly(sock, TOKEN_BYTES + _HELLO.size)
    if hello is None or not hmac.compare_digest(hello[:TOKEN_BYTES], token):
        return None
    (peer,) = _HELLO.unpack(hello[TOKEN_BYTES:])
    return peer


def connect(host: str, port: int, token: bytes, me: int) -> socket.socket:
    """Connector side: connect to the channel listening at ``(host, port)`` with ``token``,
    check its greeting, then say hello as worker ``me``. Raises ``ConnectionError`` when what
    answers there is not that channel, having written nothing to it."""
    sock = socket.create_connection((host, port), timeout=TIMEOUT_S)
    try:
        got = read_exactly(sock, _GREETING_BYTES)
        if got is None or not hmac.compare_digest(got, greeting(token)):
            raise ConnectionError(
                f"{host}:{port} did not answer as the channel whose address was given (its "
                "channel closed and another listener took the port?); nothing was sent to it"
            )
        sock.sendall(token + _HELLO.pack(me))
    except BaseException:
        sock.close()
        raise
    return sock
