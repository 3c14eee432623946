"""How the engine's messages travel (refimpl/distributed_autograd/messaging.py): on the gradient
channel, or as RPCs with the channel switched off; the gradients are the same either way."""

from __future__ import annotations

import pytest
import torch

from tests.refimpl.distributed_autograd import dist_autograd_cases as cases
from tests.refimpl.distributed_autograd.dist_autograd_cases import assert_grads, tensors
from tests.refimpl.distributed_autograd.dist_autograd_world import (
    channel_calls,
    set_channel,
    wait_nothing_left,
    worker_name,
)


def _check_both_transports(world_size):
    """Every composition gives local autograd's gradients with the messages on the channel and
    with them on RPC (``REFIMPL_DIST_AUTOGRAD_CHANNEL=rpc``); each setting takes its path."""
    import refimpl.distributed_autograd as dist_autograd

    workers = [worker_name(r) for r in range(world_size)]
    try:
        for mode in ("rpc", "socket"):
            for w in workers:
                dist_autograd.rpc_sync(w, set_channel, args=(mode,))
            before = sum(dist_autograd.rpc_sync(w, channel_calls) for w in workers)
            for seed, case in enumerate(cases.CASES):
                x, w = tensors(seed)
                expected = torch.autograd.grad(case("local", x, w), [x, w], allow_unused=True)
                with dist_autograd.context() as cid:
                    dist_autograd.backward(cid, [case("refimpl", x, w)])
                    got = dist_autograd.get_gradients(cid)
                    assert_grads(f"{case.__name__}/{mode}", got, [x, w], expected)
            sent = sum(dist_autograd.rpc_sync(w, channel_calls) for w in workers) - before
            if mode == "rpc":
                assert sent == 0, f"{sent} messages went over the channel it was switched off"
            else:
                # (the first messages to each peer go over RPC while its connection opens)
                assert sent > 0, "no message used the channel"
    finally:
        for w in workers:
            dist_autograd.rpc_sync(w, set_channel, args=("socket",))
    wait_nothing_left(world_size)


@pytest.mark.slow
def test_backward_over_the_channel_and_over_rpc(rpc_world):
    rpc_world.run(_check_both_transports)
