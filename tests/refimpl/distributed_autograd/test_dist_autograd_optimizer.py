"""DistributedOptimizer: remote parameters stepped with a context's gradients."""

from __future__ import annotations

import pytest
import torch

from tests.refimpl.distributed_autograd import dist_autograd_ps as ps
from tests.refimpl.distributed_autograd.dist_autograd_world import worker_name


def _local_reference(seed_a, seed_b, dim, x, steps, lr):
    """The same model in one process: params of two servers, SGD on the summed loss."""
    params = []
    for seed in (seed_a, seed_b):
        g = torch.Generator().manual_seed(seed)
        params += [
            torch.randn(dim, dim, generator=g).requires_grad_(),
            torch.randn(dim, generator=g).requires_grad_(),
        ]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        wa, ba, wb, bb = params
        h = torch.tanh(x @ wa + ba)
        loss = torch.tanh(h @ wb + bb).sum()
        loss.backward()
        opt.step()
    return [p.detach() for p in params]


def _check_optimizer(world_size):
    import refimpl.distributed_autograd as dist_autograd
    from refimpl.distributed_autograd import DistributedOptimizer

    dim, steps, lr = 4, 3, 0.1
    x = torch.randn(2, dim)
    rrefs = dist_autograd.rpc_sync(worker_name(1), ps.create_params, args=(11, dim))
    rrefs += dist_autograd.rpc_sync(worker_name(2), ps.create_params, args=(22, dim))
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=lr, momentum=0.9)
    for _ in range(steps):
        with dist_autograd.context() as cid:
            h = dist_autograd.rpc_sync(worker_name(1), ps.forward, args=(x,))
            loss = dist_autograd.rpc_sync(worker_name(2), ps.forward, args=(h,)).sum()
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
    got = [
        *dist_autograd.rpc_sync(worker_name(1), ps.snapshot).values(),
        *dist_autograd.rpc_sync(worker_name(2), ps.snapshot).values(),
    ]
    expected = _local_reference(11, 22, dim, x, steps, lr)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(g, e, msg=lambda m, i=i: f"param {i} after {steps} steps: {m}")
    # .grad of the remote parameters is left untouched
    assert all(r.to_here().grad is None for r in rrefs)

    # step with an unknown context fails on the owner, naming it
    with pytest.raises(RuntimeError, match="Error on Node 1: .*Could not find autograd context"):
        opt.step(12345)


@pytest.mark.slow
def test_distributed_optimizer_matches_local_sgd(rpc_world):
    rpc_world.run(_check_optimizer)
