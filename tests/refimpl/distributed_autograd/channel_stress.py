"""Stress for the gradient channel: its bytes never reach another protocol's stream.

The crash it guards against (issue 40): a process running refimpl's distributed autograd
aborted with ``std::bad_alloc``. TensorPipe and gloo read a length first and allocate it, so
the channel's bytes written into one of their streams abort the process that reads them. Two
ways the channel could do that are what this stress provokes (connection.py [Note: a descriptor
outlives its users], handshake.py [Note: nothing is written to a listener that did not say who
it is]): a descriptor closed under a thread still writing to it, and a connection to an address
that went stale between the RPC that fetched it and the connect.

One run: three channels (workers 0-2) in this process, whose address lookups answer late, as an
RPC does on a loaded machine; threads that keep the cores busy (torch kernels, which release the
GIL); many short rounds of calls like a backward pass's — gradient lists forwarded to a third
worker, empty lists (a handler that answers with no gradients), empty answers, large lists
that leave writes to the writer threads — from several threads at once; and churn: a worker's
channel is replaced (its RPC agent restarted) while calls are in flight, and its port is taken
at once by a *victim*, a listener that reads the way TensorPipe does (a length first), while
more victim sockets are opened and closed all the time to take freed descriptors. A victim that
receives any byte is the failure: it names the length TensorPipe would have allocated.

``python -m tests.refimpl.distributed_autograd.channel_stress --runs 200`` prints the counts;
the test (test_dist_autograd_stress.py) runs it ``REFIMPL_CHANNEL_STRESS_RUNS`` times (1).
"""

from __future__ import annotations

import argparse
import random
import socket
import struct
import threading
import time

import torch

from refimpl.distributed_autograd import channel as channel_mod
from refimpl.distributed_autograd.channel import Channel

WORKERS = 3
_WORLD: dict[int, Channel] = {}  # worker -> its channel now (handlers look their own up here)


class Victim:
    """A listener of another protocol: it reads an 8-byte little-endian length first, as
    TensorPipe's connections do, and writes nothing; every byte it receives is recorded."""

    def __init__(self, port: int = 0) -> None:
        self.got: list[str] = []
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        conn.settimeout(0.5)
        try:
            data = conn.recv(8)
        except OSError:
            data = b""
        if data:
            (length,) = struct.unpack("<Q", data.ljust(8, b"\0"))
            self.got.append(f"{len(data)} bytes {data.hex()}: would allocate {length} bytes")
        conn.close()

    def churn(self, stop: threading.Event) -> None:
        """Open and close connections to itself: new descriptors, taken as soon as freed."""
        while not stop.is_set():
            socks = []
            try:
                for _ in range(4):
                    socks.append(socket.create_connection(("127.0.0.1", self.port), timeout=1))
            except OSError:
                pass
            time.sleep(0.001)
            for s in socks:
                s.close()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _taken_over(port: int) -> Victim | None:
    """A victim on ``port`` once the closed channel's listener has let it go."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            return Victim(port)
        except OSError:
            time.sleep(0.002)
    return None


# handlers (run on the receiving worker's channel thread) ----------------------------------------
def _forward(me: int, to: int, tail: list) -> None:
    """A gradient message: pass the list on to a third worker, asking no answer."""
    channel = _WORLD.get(me)
    if channel is not None and not channel.closed:
        channel.call(to, _sink, (), None, [t * 2 for t in tail])


def _sink(tail: list) -> None:
    return None


def _nothing(tail: list) -> None:  # answers with no gradients at all
    return None


class _Lookups:
    """Address lookups that answer late (an RPC on a loaded machine): the address is the one
    the worker had when asked, so it may be stale by the time the answer arrives."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.stale = 0

    def __call__(self, dst: int) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        channel = _WORLD[dst]
        try:
            address = channel.address()
        except RuntimeError as exc:
            fut.set_exception(exc)
            return fut
        delay = self.rng.uniform(0.0, 0.02)
        late = self.rng.random() < 0.5  # this answer comes after the peer's restart, if any

        def answer() -> None:
            time.sleep(delay)
            deadline = time.monotonic() + 0.05
            while late and _WORLD.get(dst) is channel and time.monotonic() < deadline:
                time.sleep(0.002)
            if _WORLD.get(dst) is not channel:
                self.stale += 1
            fut.set_result(address)

        threading.Thread(target=answer, daemon=True).start()
        return fut


def _burn(stop: threading.Event) -> None:
    a = torch.randn(128, 128)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def _traffic(rng: random.Random, stop: threading.Event) -> None:
    while not stop.is_set():
        src, dst = rng.sample(range(WORKERS), 2)
        third = next(w for w in range(WORKERS) if w not in (src, dst))
        kind = rng.random()
        if kind < 0.15:
            tail = [torch.randn(1 << rng.randint(16, 19))]  # 256 KiB - 2 MiB: deferred writes
        elif kind < 0.4:
            tail = []  # no gradients
        else:
            tail = [torch.randn(rng.randint(1, 64)) for _ in range(rng.randint(1, 4))]
        channel = _WORLD[src]
        if rng.random() < 0.5:
            channel.call(dst, _forward, (dst, third), None, tail)
        else:
            channel.call(dst, _nothing, (), lambda answer, error: None, tail)
        if rng.random() < 0.05:
            time.sleep(0.001)


def run_once(seed: int, seconds: float = 2.0) -> dict:
    """One run; returns {"victim_bytes": [...], "replaced": n, "stale": n}."""
    rng = random.Random(seed)
    lookups = _Lookups(rng)
    rpc_timeout = channel_mod.rpc.get_rpc_timeout
    channel_mod.rpc.get_rpc_timeout = lambda: 60.0  # no RPC agent in this process
    stop = threading.Event()
    victims: list[Victim] = [Victim()]
    for w in range(WORKERS):
        _WORLD[w] = Channel(w, lookups)
    threads = [threading.Thread(target=_burn, args=(stop,), daemon=True) for _ in range(2)]
    threads += [threading.Thread(target=victims[0].churn, args=(stop,), daemon=True)]
    threads += [
        threading.Thread(target=_traffic, args=(random.Random(seed * 31 + i), stop), daemon=True)
        for i in range(3)
    ]
    for t in threads:
        t.start()
    replaced = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.005, 0.03))
            w = rng.randrange(WORKERS)
            old = _WORLD[w]
            _, port, _ = old.address()
            _WORLD[w] = Channel(w, lookups)  # its RPC agent was replaced
            old.close(fail_calls=False)
            victim = _taken_over(port)
            if victim is not None:
                victims.append(victim)
            replaced += 1
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        time.sleep(0.7)  # victims read what late connections sent
        for channel in _WORLD.values():
            channel.close(fail_calls=False)
        _WORLD.clear()
        for victim in victims:
            victim.close()
        channel_mod.rpc.get_rpc_timeout = rpc_timeout
    return {
        "victim_bytes": [g for v in victims for g in v.got],
        "replaced": replaced,
        "stale": lookups.stale,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    failures, stale, t0 = 0, 0, time.perf_counter()
    for i in range(args.runs):
        out = run_once(i, args.seconds)
        stale += out["stale"]
        if out["victim_bytes"]:
            failures += 1
            print(f"run {i}: a victim received channel bytes: {out['victim_bytes'][0]}", flush=True)
    wall = time.perf_counter() - t0
    print(f"runs {args.runs}, failures {failures}, stale addresses {stale}, wall {wall:.0f} s")


if __name__ == "__main__":
    main()
