"""Spawn a gloo world on loopback and run one function on every rank (test helper).

The ranks rendezvous through a FileStore in a private temp dir (no port to race for under
pytest-xdist, no socket another host could reach) and gloo is pinned to the loopback
interface (see conformance/harness/network.py); every wait has a timeout, a rank's exception
fails the test with its traceback, and the temp dir is removed afterwards.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from conformance.harness.watchdog import Watchdog

# The ranks' own collective/rendezvous timeout only bounds a rank stuck for good: hangs are
# detected from outside by the pool's Watchdog (no CPU used), so a loaded machine that starves
# one rank for a while never turns into a failure.
TIMEOUT = timedelta(seconds=600)


def _entry(rank, fn, world_size, store_path, out_dir, args):
    import faulthandler

    import torch

    # A rank killed by a signal (SIGABRT from C++, SIGSEGV) prints its Python stack on stderr,
    # so the failure names the line it died on instead of only "terminated with signal".
    faulthandler.enable(all_threads=True)

    from conformance.harness.network import join_local_group

    torch.set_num_threads(1)
    join_local_group(store_path, rank, world_size, timeout=TIMEOUT)
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as fh:
            pickle.dump(result, fh)
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's finalizers, as the suite's pool ranks do
    # (conformance/harness/service.py): after a successful run, gloo's transport can still
    # abort the process while C++ statics are destroyed ("terminate called without an active
    # exception", no Python frame on any thread). The result is written and the group is gone
    # by now; a rank that raised never gets here, so its traceback still reaches the parent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_world(fn, world_size: int = 2, *args, timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on every rank; return each rank's result.

    A rank that raises fails with its traceback, and one that exits without a result is a
    failure too. ``timeout`` is a budget, not a verdict (see [Note: timeouts under load] in
    conformance/harness/watchdog.py): once spent, the world is declared hung only when no rank has
    used CPU for a while, or when it is still busy after many times the budget.
    """
    out_dir = tempfile.mkdtemp(prefix="refimpl-world-")
    try:
        return _run(fn, world_size, args, timeout, out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _run(fn, world_size: int, args, timeout: float, out_dir: str) -> list:
    store_path = os.path.join(out_dir, "rendezvous")
    ctx = mp.start_processes(
        _entry, args=(fn, world_size, store_path, out_dir, args), nprocs=world_size, join=False, start_method="spawn"
    )
    watchdog = Watchdog([p.pid for p in ctx.processes], timeout)
    try:
        while not ctx.join(timeout=0.5):
            why = watchdog.hung()
            if why:
                raise TimeoutError(f"world of {world_size} ranks running {fn.__name__}: {why}")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    results = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        assert os.path.exists(path), f"rank {rank} of {fn.__name__} exited without a result"
        with open(path, "rb") as fh:
            results.append(pickle.load(fh))
    return results
