"""The slow tests' RPC world, gradient channel included, listens on loopback only
(conformance/harness/network.py)."""

from __future__ import annotations

import os

import pytest

from conformance.harness.network import listeners_of


def _backward_until_the_channel_is_used(world_size: int) -> None:
    """Chain backwards until their messages travel on the gradient channel (the first ones go
    over RPC while it connects): RPC is up on every worker and the channel listens too."""
    import time

    import torch

    import refimpl.distributed_autograd as dist_autograd
    from tests.refimpl.distributed_autograd import dist_autograd_cases as cases
    from tests.refimpl.distributed_autograd.dist_autograd_world import channel_calls

    workers = [f"worker{r}" for r in range(world_size)]
    deadline = time.monotonic() + 120
    while sum(dist_autograd.rpc_sync(w, channel_calls) for w in workers) == 0:
        assert time.monotonic() < deadline, "no backward message ever used the channel"
        x, w = (torch.randn(3, 3, requires_grad=True) for _ in range(2))
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [cases.chain("refimpl", x, w)])


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp (Linux)")
@pytest.mark.slow
def test_rpc_world_listens_on_loopback_only(rpc_world):
    rpc_world.run(_backward_until_the_channel_is_used)
    listeners = listeners_of([p.pid for p in rpc_world.procs])
    assert listeners, "TensorPipe listens somewhere: finding no socket means the check is blind"
    wide = [str(s) for s in listeners if not s.loopback]
    assert not wide, f"RPC world sockets listening beyond loopback: {wide}"
    assert len(listeners) > len(rpc_world.procs), "the channel's listeners are missing"
