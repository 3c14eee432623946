"""A warm RPC world for the slow tests: spawned once, runs many checks.

Spawning a world costs seconds (import torch in every process + rendezvous), so the slow tests
share one world of ``WORLD_SIZE`` workers (a session fixture in ``conftest.py``). Every worker
pins TensorPipe to the loopback interface and rendezvouses through a ``file://`` store in a
private temp dir (no TCPStore listening on every interface, no port to race for: see
conformance/harness/network.py [Note: loopback]) and runs ``torch.set_num_threads(1)``;
worker 0 takes check functions (picklable by reference) from a queue, runs
``check(world_size)`` and answers with ``ok`` or the traceback; the others serve RPCs.

Waits are load-robust: a check's timeout is a budget judged by the pool's ``Watchdog`` (a
world that uses no CPU past its budget, or a dead worker, is hung; a slow one is not). A hung
check kills the world and fails that test; the next test gets a fresh world.

[Note: quiet shutdown]
``rpc.shutdown(graceful=True)`` is an all-gather over RPC led by worker 0. If the followers
enter it while worker 0 is still running checks, they give up waiting after the shutdown
timeout, shut down, and worker 0's broadcast later fails with a "Followers [...] timed out in
_all_gather" traceback in a passing run. So the followers wait for a stop event that is set
only once worker 0 has left its check loop; then all workers enter the graceful shutdown
together, with no timeout of its own (the parent's Watchdog bounds it).
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile

import torch
import torch.multiprocessing as mp

from conformance.harness.watchdog import Watchdog

# Bounds an RPC stuck for good; hangs are judged from outside by the Watchdog, so a loaded
# machine that starves a worker for a while never turns into a failure.
RPC_TIMEOUT_S = 300.0
WORLD_SIZE = 3


def worker_name(rank: int) -> str:
    return f"worker{rank}"


def wait_nothing_left(world_size: int, timeout: float = 60.0) -> None:
    """Wait until no worker holds a context or a pass; fail naming what is left after
    ``timeout`` s. A context exit releases the other workers without waiting for them
    (lifetime.py [Note: context release]), so a check right after it must allow for the messages
    in flight; a leak never clears."""
    import time

    import refimpl.distributed_autograd as dist_autograd

    empty = {"num_current_backward_passes": 0, "num_autograd_contexts": 0}
    deadline = time.monotonic() + timeout
    while True:
        infos = {r: dist_autograd.rpc_sync(worker_name(r), dist_autograd._get_debug_info)
                 for r in range(world_size)}
        left = {r: info for r, info in infos.items() if info != empty}
        if not left:
            return
        assert time.monotonic() < deadline, f"left after {timeout:.0f} s: {left}"
        time.sleep(0.02)


def set_channel(mode: str) -> None:
    """The environment variable as a fresh agent reads it, and the running agent's switch."""
    import importlib
    import os

    from refimpl.distributed_autograd import channel

    os.environ[channel.ENV] = mode
    importlib.import_module("refimpl.distributed_autograd.context").container().use_channel = (
        channel.enabled()
    )


def channel_calls() -> int:
    """Messages this worker sent on its gradient channel so far."""
    import importlib

    cont = importlib.import_module("refimpl.distributed_autograd.context").container()
    return 0 if cont._channel is None else cont._channel.calls_sent


def _serve(rank: int, world_size: int, store_path: str, tasks, results, stop) -> None:
    from conformance.harness.network import pin_to_loopback

    pin_to_loopback()  # before TensorPipe creates a transport
    torch.set_num_threads(1)
    from torch.distributed import rpc

    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"file://{store_path}",
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
                    import traceback

                    results.put(("error", traceback.format_exc()))
                else:
                    results.put(("ok", ""))
            stop.set()
        else:
            stop.wait()
    finally:
        rpc.shutdown(graceful=True)  # see [Note: quiet shutdown]


class RpcWorld:
    def __init__(self, world_size: int = WORLD_SIZE, start_timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self.tasks = ctx.Queue()
        self.results = ctx.Queue()
        self.stop = ctx.Event()
        self.tmp = tempfile.mkdtemp(prefix="refimpl-rpc-world-")  # 0700: private
        store = os.path.join(self.tmp, "rendezvous")
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(r, world_size, store, self.tasks, self.results, self.stop),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.broken = False
        self._expect("ready", start_timeout_s, "start")

    def _expect(self, status: str, timeout_s: float, what: str) -> None:
        watchdog = Watchdog([p.pid for p in self.procs], timeout_s)
        while True:
            try:
                got, detail = self.results.get(timeout=0.5)
                break
            except queue.Empty:
                dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
                why = f"workers {dead} died" if dead else watchdog.hung()
                if why:
                    self.kill()
                    raise AssertionError(f"RPC world {what}: {why}") from None
        if got != status:
            raise AssertionError(f"check failed on worker 0:\n{detail}")

    def run(self, check, timeout_s: float = 60.0) -> None:
        """Run ``check(world_size)`` on worker 0; raise with its traceback if it failed."""
        assert not self.broken, "this RPC world was killed after it hung"
        self.tasks.put(check)
        self._expect("ok", timeout_s, getattr(check, "__name__", "check"))

    def kill(self) -> None:
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def close(self, timeout_s: float = 60.0) -> None:
        """Shut the world down gracefully (all workers together); kill it if that hangs."""
        if not self.broken:
            self.tasks.put(None)
            watchdog = Watchdog([p.pid for p in self.procs], timeout_s)
            while any(p.is_alive() for p in self.procs) and not watchdog.hung():
                for p in self.procs:
                    p.join(0.5)
        self.kill()
