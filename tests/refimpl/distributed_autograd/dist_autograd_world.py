"""A warm RPC world for the slow tests: spawned once, runs many checks.

Spawning a world costs seconds (import torch in every process + rendezvous), so the slow tests
share one world of ``WORLD_SIZE`` workers (a session fixture in ``conftest.py``). Every worker
joins RPC over TensorPipe on 127.0.0.1 and runs ``torch.set_num_threads(1)``; worker 0 takes
check functions (picklable by reference) from a queue, runs ``check(world_size)`` and answers
with ``ok`` or the traceback; the others serve RPCs. Every wait has a timeout: a check that
does not answer in time kills the world, fails that test, and the next test gets a fresh world.
"""

from __future__ import annotations

import queue
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

RPC_TIMEOUT_S = 20.0
WORLD_SIZE = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_name(rank: int) -> str:
    return f"worker{rank}"


def _serve(rank: int, world_size: int, port: int, tasks, results) -> None:
    torch.set_num_threads(1)
    from torch.distributed import rpc

    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}",
        rpc_timeout=RPC_TIMEOUT_S,
        num_worker_threads=8,
        _transports=["uv"],
    )
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
    try:
        if rank == 0:
            results.put(("ready", ""))
            while (check := tasks.get()) is not None:
                try:
                    check(world_size)
                except BaseException:
                    results.put(("error", traceback.format_exc()))
                else:
                    results.put(("ok", ""))
    finally:
        rpc.shutdown(graceful=True, timeout=RPC_TIMEOUT_S)


class RpcWorld:
    def __init__(self, world_size: int = WORLD_SIZE, start_timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self.tasks = ctx.Queue()
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_serve, args=(r, world_size, port, self.tasks, self.results), daemon=True
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.broken = False
        self._expect("ready", start_timeout_s, "start")

    def _expect(self, status: str, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                got, detail = self.results.get(timeout=0.5)
                break
            except queue.Empty:
                dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.kill()
                    reason = f"workers {dead} died" if dead else f"no answer in {timeout_s}s"
                    raise AssertionError(f"RPC world {what}: {reason}") from None
        if got != status:
            raise AssertionError(f"check failed on worker 0:\n{detail}")

    def run(self, check, timeout_s: float = 60.0) -> None:
        """Run ``check(world_size)`` on worker 0; raise with its traceback if it failed."""
        assert not self.broken, "this RPC world was killed after a timeout"
        self.tasks.put(check)
        self._expect("ok", timeout_s, getattr(check, "__name__", "check"))

    def kill(self) -> None:
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)

    def close(self, timeout_s: float = 30.0) -> None:
        if not self.broken:
            self.tasks.put(None)
            for p in self.procs:
                p.join(timeout_s)
        self.kill()
