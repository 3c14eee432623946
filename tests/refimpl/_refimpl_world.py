"""Spawn a gloo world on 127.0.0.1 and run one function on every rank (test helper).

The parent process owns the TCPStore (port 0: the OS picks a free port, safe under
pytest-xdist), every wait has a timeout, and a rank's exception fails the test with its
traceback.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = timedelta(seconds=60)


def _entry(rank, fn, world_size, port, out_dir, args):
    import torch

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as fh:
            pickle.dump(result, fh)
    finally:
        dist.destroy_process_group()


def run_world(fn, world_size: int = 2, *args, timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on every rank; return each rank's result.

    A rank that raises fails with its traceback, one that hangs is killed after ``timeout``
    seconds, and one that exits without a result is a failure too.
    """
    out_dir = tempfile.mkdtemp(prefix="refimpl-world-")
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    ctx = mp.start_processes(
        _entry, args=(fn, world_size, store.port, out_dir, args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"world of {world_size} ranks running {fn.__name__} did not finish in {timeout}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    del store
    results = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        assert os.path.exists(path), f"rank {rank} of {fn.__name__} exited without a result"
        with open(path, "rb") as fh:
            results.append(pickle.load(fh))
    return results
