"""Small tasks that exercise the harness itself: used by its tests and the overhead benchmark.

Each misbehaves in one way a real implementation can: raise on one rank, die, or block in a
collective that the other ranks never join.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def echo(payload, ctx):
    """All-reduce the rank ids: proves the group works and returns quickly."""
    t = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(t, group=ctx.group)
    return {"rank": ctx.rank, "sum": t.item(), "payload": payload}


def raise_on(payload, ctx):
    """Rank `payload` raises; the others block in a collective it never joins."""
    if ctx.rank == payload:
        raise ValueError(f"deliberate failure on rank {ctx.rank}")
    dist.all_reduce(torch.zeros(1, device=ctx.device), group=ctx.group)
    return ctx.rank


def exit_on(payload, ctx):
    """Rank `payload` dies abruptly (os._exit), as a segfaulting extension would."""
    if ctx.rank == payload:
        os._exit(3)
    dist.all_reduce(torch.zeros(1, device=ctx.device), group=ctx.group)
    return ctx.rank


def abort_on(payload, ctx):
    """Rank `payload` aborts (SIGABRT) after a last word on stderr, as a C++ assertion would."""
    if ctx.rank == payload:
        import sys

        print(f"RuntimeError: deliberate abort on rank {ctx.rank}", file=sys.stderr, flush=True)
        os.abort()
    dist.all_reduce(torch.zeros(1, device=ctx.device), group=ctx.group)
    return ctx.rank


def hang_on(payload, ctx):
    """Every rank but `payload` waits in an all_reduce that rank `payload` never joins."""
    if ctx.rank == payload:
        time.sleep(3600)
    dist.all_reduce(torch.zeros(1, device=ctx.device), group=ctx.group)
    return ctx.rank


def leave_pending(payload, ctx):
    """Rank 0 launches an extra async collective: the group is left inconsistent."""
    if ctx.rank == 0:
        dist.all_reduce(torch.zeros(1, device=ctx.device), group=ctx.group, async_op=True)
    return ctx.rank


def rpc_echo(payload, ctx):
    """Start torch.distributed.rpc (TensorPipe) and call the next rank: opens RPC's listeners."""
    from torch.distributed import rpc

    ctx.ensure_rpc()
    peer = f"worker{(ctx.rank + 1) % ctx.world_size}"
    return rpc.rpc_sync(peer, max, args=(ctx.rank, payload))


def busy(payload, ctx):
    """Every rank computes for `payload` seconds of wall time, then joins a collective: slow, not hung."""
    deadline = time.monotonic() + payload
    x = 0
    while time.monotonic() < deadline:
        x += 1
    dist.all_reduce(torch.zeros(1, device=ctx.device), group=ctx.group)
    return ctx.rank


def hsdp_case(payload, ctx):
    """Get a HSDP case's (replicate, shard) mesh as the sharded adapters do; answer whether its
    process groups are the previous such task's (one mesh per rank process, not one per case)."""
    from conformance.adapters.sharded import hsdp_mesh

    groups = [id(g) for g in hsdp_mesh(ctx, payload).get_all_groups()]
    previous, ctx.scratch["previous_hsdp_groups"] = ctx.scratch.get("previous_hsdp_groups"), groups
    return {"same_groups": previous == groups, "first": previous is None}


def device_less_all_reduce(payload, ctx):
    """All-reduce a tensor built without ``device=`` (on a GPU it is a CPU tensor: NCCL refuses
    it); with ``payload`` true, the same built on the rank's device."""
    t = torch.ones(1, device=ctx.device) if payload else torch.ones(1)
    dist.all_reduce(t, group=ctx.group)
    return t.item()
