"""The `contexts-meet` scenario of the `dist_autograd` area (clause A18, issue 40): contexts
opened on two workers at once whose graphs meet on a third.

Worker 0 (the caller of every other scenario) and worker 1 each open a context and run the same
composition through worker 2's parameter `w2` (`contexts_meet` in conformance/models/
dist_autograd.py), so both contexts are alive on worker 2 at the same time. Worker 1's context
runs its backward, reads its gradients and exits (releasing itself on worker 2) while worker 0's
context is still open there; then worker 0 runs its backward. Each context must hold its own
caller's gradients and `w2`'s gradient of its own pass only, and the two ids must differ.

[Note: bringing the counts level]
An engine that numbers contexts per worker (no worker part in the id) hands out the same id on
two workers only when both have opened as many contexts. In a warm pool the caller has opened
many more than worker 1, so before the two contexts are opened the worker behind opens and exits
empty contexts until both have opened as many — as far as the last ids opened on each tell:
their difference, when it is small (at most `LEVEL_LIMIT`). torch's ids differ by the worker id
in their top 16 bits (2^48 apart), so a correct engine is never levelled and loses nothing.

Worker 1's part runs on one of its RPC threads (`peer_side`), called with torch's own RPC
outside any context (so no context travels with it); it waits for worker 0's go (`peer_go`)
between its forward and its backward. Nothing is judged on the workers (the runner's
`_judge_meet` judges the record).
"""

from __future__ import annotations

import threading

from torch.distributed import rpc

from conformance.models import dist_autograd as fns
from conformance.runners.dist_autograd_workers import (
    _all_grads,
    _debug_infos,
    _named_grads,
    _wait_clean,
    fetch_grads,
)

LEVEL_LIMIT = 100_000  # contexts opened at most to bring two workers' counts level
WAIT_S = 60.0  # how long worker 1 waits for worker 0's go, and worker 0 for worker 1's forward
_READY = threading.Event()  # on worker 1: its context's forward is done
_GO = threading.Event()  # on worker 1: worker 0's context is open on worker 2 too


# -- on worker 1 -------------------------------------------------------------------------------------
def open_ids(mode: str, n: int) -> int:
    """Open and exit `n` contexts on this worker (nothing crosses an RPC); the last one's id."""
    adapter = fns.adapter_for(mode)
    last = -1
    for _ in range(n):
        with adapter.context() as opened:
            last = opened
    return last


def peer_side(mode: str, seed: int) -> dict:
    """Worker 1's context: forward through worker 2, wait for the go, backward, read its
    gradients here and on worker 2, exit. Returns {"id", "grads", "error"}."""
    _GO.clear()
    _READY.clear()
    adapter = fns.adapter_for(mode)
    leaves = fns.leaves(seed + fns.PEER_SEED)
    out: dict = {"id": None, "grads": {}, "error": None}
    try:
        with adapter.context() as context_id:
            out["id"] = context_id
            roots = fns.contexts_meet(mode, seed, leaves)
            _READY.set()
            if not _GO.wait(WAIT_S):
                raise RuntimeError(f"worker0 did not open its context within {WAIT_S:g} s")
            adapter.backward(context_id, roots)
            grads = _named_grads(adapter, mode, seed, context_id, 1, leaves)
            grads.update(rpc.rpc_sync("worker2", fetch_grads, args=(mode, seed, context_id)))
            out["grads"] = grads
    except Exception as exc:  # noqa: BLE001 - judged by the coordinator
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _READY.set()
    return out


def peer_ready() -> bool:
    return _READY.wait(WAIT_S)


def peer_go() -> None:
    _GO.set()


# -- on worker 0 -------------------------------------------------------------------------------------
def _level(mode: str) -> dict:
    """[Note: bringing the counts level]: the last ids opened on workers 0 and 1 before, and how
    many contexts the worker behind opened to catch up."""
    mine = open_ids(mode, 1)
    theirs = rpc.rpc_sync("worker1", open_ids, args=(mode, 1))
    gap = mine - theirs
    if 0 < gap <= LEVEL_LIMIT:
        rpc.rpc_sync("worker1", open_ids, args=(mode, gap))
    elif 0 < -gap <= LEVEL_LIMIT:
        open_ids(mode, -gap)
    return {"last_ids": (mine, theirs), "opened": abs(gap) if abs(gap) <= LEVEL_LIMIT else 0}


def run_meet(adapter, mode: str, scenario) -> dict:
    """Worker 0's side; the record the runner's `_judge_meet` reads."""
    seed, world = scenario.seed, scenario.world_size
    before = _debug_infos(mode, world)
    rec: dict = {"passes": [], "error": None, "dot_grad": [], "shared": [], "ids": {}, "peer": None}
    rec["level"] = _level(mode)
    leaves = fns.leaves(seed)
    peer = rpc.rpc_async("worker1", peer_side, args=(mode, seed))
    if not rpc.rpc_sync("worker1", peer_ready):
        rec["error"] = f"worker1's context did not run its forward within {WAIT_S:g} s"
    with adapter.context() as context_id:
        rec["ids"][0] = context_id
        roots = fns.contexts_meet(mode, seed, leaves)
        rpc.rpc_sync("worker1", peer_go)
        try:
            rec["peer"] = peer.wait()
        except Exception as exc:  # noqa: BLE001 - judged by the coordinator
            rec["peer"] = {"id": None, "grads": {}, "error": f"{type(exc).__name__}: {exc}"}
        rec["ids"][1] = rec["peer"]["id"]
        try:
            adapter.backward(context_id, roots)
        except Exception as exc:  # noqa: BLE001 - judged by the coordinator
            rec["error"] = rec["error"] or f"{type(exc).__name__}: {exc}"
        else:
            rec["passes"].append(_all_grads(adapter, mode, seed, context_id, leaves, world))
    rec["dot_grad"] = [n for n, t in leaves.items() if t.grad is not None]
    rec["cleanup"] = _wait_clean(mode, world, before)
    return rec
