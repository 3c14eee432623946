"""Spawn a small RPC world and run a check function on worker 0 (helpers for the tests).

Every worker joins RPC over TensorPipe on 127.0.0.1, runs ``torch.set_num_threads(1)``;
worker 0 runs ``check(world_size)`` while the others serve RPCs; all shut down together.
A failure on worker 0 surfaces in the pytest process with its traceback; the whole world has
a wall-clock limit.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.multiprocessing as mp

RPC_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_name(rank: int) -> str:
    return f"worker{rank}"


def _worker(rank: int, world_size: int, port: int, check) -> None:
    torch.set_num_threads(1)
    from torch.distributed import rpc

    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}",
        rpc_timeout=RPC_TIMEOUT_S,
        num_worker_threads=8,
        _transports=["uv"],
    )
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
    try:
        if rank == 0:
            check(world_size)
    finally:
        rpc.shutdown(graceful=True, timeout=RPC_TIMEOUT_S)


def run_world(check, world_size: int, timeout_s: float = 45.0) -> None:
    """Run ``check(world_size)`` on worker 0 of a fresh spawned RPC world."""
    ctx = mp.start_processes(
        _worker,
        args=(world_size, free_port(), check),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"RPC world of {world_size} did not finish in {timeout_s}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
