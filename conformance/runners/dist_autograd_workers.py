"""What the `dist_autograd` rank task reads on every worker (conformance/runners/dist_autograd.py,
dist_autograd_meet.py): a context's gradients by name, the workers' debug info, and the wait until
no context or pass is left. Nothing here judges."""

from __future__ import annotations

import re
import time

from conformance.models import dist_autograd as fns

# Contexts are released by asynchronous RPC messages, which a loaded machine can delay: the
# wait ends when every worker is clean, when the leftovers have not changed for CLEANUP_QUIET_S
# (a leak stays put), or at CLEANUP_WAIT_S in all.
CLEANUP_QUIET_S = 10.0
CLEANUP_WAIT_S = 60.0


def _named_grads(adapter, mode: str, seed: int, context_id: int, rank: int, local_leaves: dict) -> dict:
    """This worker's gradients in `context_id`, by name; a worker without the context has none."""
    try:
        grads = adapter.get_gradients(context_id)
    except Exception as exc:  # noqa: BLE001 - no context here: nothing reached this worker
        if re.search(r"(?i)context", str(exc)):
            return {}
        raise
    names = {id(t): f"{n}@worker{rank}" for n, t in local_leaves.items()}
    names.update({id(t): f"{n}@worker{rank}" for n, t in fns.owned_params(mode, seed).items()})
    out, unnamed = {}, 0
    for t, g in grads.items():
        name = names.get(id(t))
        if name is None:
            name = f"<unnamed tensor {unnamed} of shape {tuple(t.shape)}>@worker{rank}"
            unnamed += 1
        out[name] = g.detach().to("cpu", copy=True)
    return out


def fetch_grads(mode: str, seed: int, context_id: int) -> dict:
    from torch.distributed import rpc

    adapter = fns.adapter_for(mode)
    return _named_grads(adapter, mode, seed, context_id, rpc.get_worker_info().id, {})


def fetch_debug_info(mode: str) -> dict:
    return dict(fns.adapter_for(mode).debug_info())


def _all_grads(adapter, mode, seed, context_id, leaves, world_size) -> dict:
    from torch.distributed import rpc

    out = _named_grads(adapter, mode, seed, context_id, 0, leaves)
    for k in range(1, world_size):
        out.update(rpc.rpc_sync(f"worker{k}", fetch_grads, args=(mode, seed, context_id)))
    return out


def _debug_infos(mode: str, world_size: int) -> dict:
    from torch.distributed import rpc

    return {k: rpc.rpc_sync(f"worker{k}", fetch_debug_info, args=(mode,)) for k in range(world_size)}


def _wait_clean(mode: str, world_size: int, before: dict | None = None) -> dict:
    """Every worker's debug info once no context and no pass is left, or once the leftovers
    have stopped changing (see CLEANUP_QUIET_S).

    `before`: the workers' context counts when the case started. A context a known-bad
    implementation leaked in an earlier case of the same warm pool stays there; it is that
    case's failure, so only contexts beyond those count here (a leak of this case still shows)."""
    start = changed_at = time.monotonic()
    previous = None
    base = {k: int((before or {}).get(k, {}).get("num_autograd_contexts", 0)) for k in range(world_size)}
    while True:
        infos = _debug_infos(mode, world_size)
        left = {k: i for k, i in infos.items()
                if int(i.get("num_autograd_contexts", 0)) > base[k] or int(i.get("num_current_backward_passes", 0))}
        now = time.monotonic()
        if left != previous:
            previous, changed_at = left, now
        if not left or now - changed_at > CLEANUP_QUIET_S or now - start > CLEANUP_WAIT_S:
            return {"clean": not left, "left": left}
        time.sleep(0.05)


