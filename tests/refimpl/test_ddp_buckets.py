"""refimpl/ddp/buckets.py: copy in, launch = scale and sum, finish = wait, copy back.

``Bucket.launch`` is the one place DDP divides by the number of ranks, before the sum; the
write-back paths (copied back, in place with ``gradient_as_bucket_view``) are pinned here,
plus the comm-hook path that must *not* scale (the hook returns the average itself). World
size 1 (in-process gloo): the all-reduce is the identity, so the expected result is exactly
``grad * scale``. One 2-rank test pins *why* it is before: float16 sums that overflow.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refimpl.ddp.buckets import Bucket
from refimpl.ddp.plan import ParamInfo, plan_buckets
from tests.refimpl._refimpl_world import run_world

LARGE = 1 << 15  # elements: a bucket of large gradients goes through the same write-back


def _bucket(shapes):
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    (plan,) = plan_buckets([ParamInfo.of(p) for p in params], 1 << 30, 1 << 30, [False] * len(params))
    bucket = Bucket(plan, [params[i] for i in plan.param_indices], is_last=True)
    grads = []
    for k, p in enumerate(bucket.params):
        p.grad = torch.arange(p.numel(), dtype=torch.float32).view(p.shape) + k + 0.25
        grads.append(p.grad.clone())
    return bucket, grads


def _reduce(bucket, group, *, as_view=False, scale=0.5, hook=None, used=None):
    for k in range(len(bucket.params)):
        bucket.copy_in(k, as_view)
    bucket.launch(group, hook, None, scale)
    bucket.finish(used, as_view)


@pytest.mark.parametrize("shapes", [[(3, 4), (5,)], [(LARGE * 2,), (LARGE,)]], ids=["small", "large"])
def test_finish_copies_back_and_scales_once(world1, shapes):
    bucket, grads = _bucket(shapes)
    same_objects = [p.grad for p in bucket.params]
    _reduce(bucket, world1, scale=0.5)
    for p, g, obj in zip(bucket.params, grads, same_objects, strict=True):
        assert p.grad is obj  # written in place, not replaced
        assert torch.equal(p.grad, g * 0.5)


def test_finish_without_divisor_leaves_the_sum(world1):
    bucket, grads = _bucket([(3, 4), (5,)])
    _reduce(bucket, world1, scale=None)
    assert all(torch.equal(p.grad, g) for p, g in zip(bucket.params, grads, strict=True))


def test_bucket_view_grads_are_scaled_in_the_buffer(world1):
    bucket, grads = _bucket([(3, 4), (LARGE,)])
    _reduce(bucket, world1, as_view=True, scale=0.25)
    for p, g, view in zip(bucket.params, grads, bucket.views, strict=True):
        assert p.grad is view
        assert torch.equal(p.grad, g * 0.25)


def test_a_comm_hook_result_is_not_scaled_again(world1):
    def halve(state, grad_bucket):
        fut = torch.futures.Future()
        fut.set_result(grad_bucket.buffer() / 2)
        return fut

    bucket, grads = _bucket([(3, 4), (5,)])
    _reduce(bucket, world1, scale=0.5, hook=halve)
    assert all(torch.equal(p.grad, g / 2) for p, g in zip(bucket.params, grads, strict=True))


def test_a_parameter_no_rank_used_keeps_its_grad(world1):
    bucket, grads = _bucket([(3, 4), (5,)])
    unused = bucket.params[1]
    unused.grad = None
    _reduce(bucket, world1, scale=0.5, used=[1, 0] if bucket.plan.param_indices == (0, 1) else [0, 1])
    assert unused.grad is None
    assert torch.equal(bucket.params[0].grad, grads[0] * 0.5)


def _fp16_average_near_the_top(rank, world_size):
    import torch.distributed as dist

    p = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    (plan,) = plan_buckets([ParamInfo.of(p)], 1 << 30, 1 << 30, [False])
    bucket = Bucket(plan, [p], is_last=True)
    p.grad = torch.full((4,), 40000.0, dtype=torch.float16)  # two of them sum past 65504
    bucket.copy_in(0, False)
    bucket.launch(dist.group.WORLD, None, None, 1.0 / world_size)
    bucket.finish(None, False)
    assert torch.equal(p.grad, torch.full((4,), 40000.0, dtype=torch.float16)), p.grad


def test_fp16_gradients_are_divided_before_they_are_summed():
    """Sum-then-divide gives inf where the average is finite (torch divides first)."""
    run_world(_fp16_average_near_the_top, 2)


def _sparse_shares_scaled_before_the_gather(rank, world_size):
    import itertools

    import torch.distributed as dist

    p = nn.Parameter(torch.zeros(4, 2, dtype=torch.float64))
    (plan,) = plan_buckets([p], 1 << 30, 1 << 30, [True])
    bucket = Bucket(plan, [p], is_last=True)
    share = [1.1, 2.2, 3.3][rank]  # (1.1+2.2+3.3)/3 is no sum of the three shares /3 in any order
    p.grad = torch.sparse_coo_tensor([[1]], torch.full((1, 2), share, dtype=torch.float64), (4, 2))
    scale = 1.0 / world_size
    bucket.launch(dist.group.WORLD, None, None, scale)
    bucket.finish(None, False)
    got = p.grad.to_dense()[1, 0].item()
    shares = [1.1 * scale, 2.2 * scale, 3.3 * scale]
    accepted = {(x + y) + z for x, y, z in itertools.permutations(shares)}
    assert got in accepted and (1.1 + 2.2 + 3.3) * scale not in accepted, got


def test_sparse_gradients_are_divided_before_they_are_gathered():
    """torch's reducer divides a sparse gradient before its all-reduce: the last bit at 3 ranks."""
    run_world(_sparse_shares_scaled_before_the_gather, 3)
