"""The sharded area's state-dict round trip (issue #26): save, rebuild from scratch, load, train on.

Called by the production loop (`conformance.runners.ddp_features`) at ``save_load_at`` when the
scenario's ``state_dict`` feature names a kind:

* ``"sharded"`` — each rank's part (DTensors) through ``torch.distributed.checkpoint``:
  ``dcp.save`` into a directory every rank shares, then the rebuilt engine's own (fresh) state
  dict is the template ``dcp.load`` fills, and the engine loads it;
* ``"full"`` — unsharded tensors, written by rank 0 with ``torch.save`` and read back by every
  rank (``weights_only=True``): the file a single process could read.

The rebuilt model comes from another seed and the old engine is closed first, so nothing
survives but the checkpoint; the oracle trains straight through (`conformance.oracle.baseline_features`),
so a load that drops any state (optimizer momentum, a buffer, one rank's chunk) shows at the
first step after it. Engines say how they give and take their state with
``Wrapped.checkpoint(kind, optimizer)`` / ``Wrapped.load_checkpoint(kind, state, optimizer)``
(`conformance.adapters.sharded_state`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist


def _shared_dir(group) -> str:
    """A directory rank 0 makes and every rank is told (the ranks share this machine's disk)."""
    path = [tempfile.mkdtemp(prefix="gradparity-ckpt-") if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(path, src=dist.get_global_rank(group, 0), group=group)
    return path[0]


def round_trip(kind: str, ctx, wrapped, optimizer, close: Callable[[object], None],
               rebuild: Callable[[], tuple[object, object]]):
    """Save `wrapped` + `optimizer` as `kind`, close them, rebuild (`rebuild()` -> (wrapped,
    optimizer)), load; returns the rebuilt pair."""
    import torch.distributed.checkpoint as dcp

    for what in ("checkpoint", "load_checkpoint"):
        if not callable(getattr(wrapped, what, None)):
            raise RuntimeError(f"a state-dict round trip needs Wrapped.{what}(kind, ...) (capability state_dict)")
    group = ctx.group
    path = _shared_dir(group)
    full_file = os.path.join(path, "full.pt")
    try:
        state = wrapped.checkpoint(kind, optimizer)
        if kind == "sharded":
            dcp.save(state, checkpoint_id=path, process_group=group)
        elif dist.get_rank(group) == 0:
            torch.save(state, full_file)
        dist.barrier(group=group)
        close(wrapped)
        del wrapped, optimizer, state
        wrapped, optimizer = rebuild()
        if kind == "sharded":
            state = wrapped.checkpoint(kind, optimizer)  # the fresh engine's: the template dcp.load fills
            dcp.load(state, checkpoint_id=path, process_group=group)
        else:
            state = torch.load(full_file, weights_only=True)
        wrapped.load_checkpoint(kind, state, optimizer)
        dist.barrier(group=group)  # every rank has read the files before rank 0 removes them
    finally:
        if dist.get_rank(group) == 0:
            shutil.rmtree(path, ignore_errors=True)
    return wrapped, optimizer
