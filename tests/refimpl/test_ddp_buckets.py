"""refimpl/ddp/buckets.py: copy in, launch a plain sum, finish = wait, copy back, scale.

``Bucket.finish`` is the one place DDP divides by the number of ranks; each of its three
write-back paths (per-gradient fused scale for large gradients, whole-buffer scale for small
ones, in place with ``gradient_as_bucket_view``) is pinned here, plus the comm-hook path that
must *not* scale (the hook returns the average itself). World size 1 (in-process gloo): the
all-reduce is the identity, so the expected result is exactly ``grad * scale``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refimpl.ddp.buckets import FUSE_MIN_NUMEL, Bucket
from refimpl.ddp.plan import ParamInfo, plan_buckets


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
    bucket.launch(group, hook, None)
    bucket.finish(used, as_view, scale)


@pytest.mark.parametrize("shapes", [[(3, 4), (5,)], [(FUSE_MIN_NUMEL * 2,), (FUSE_MIN_NUMEL,)]], ids=["small", "large"])
def test_finish_copies_back_and_scales_once(world1, shapes):
    bucket, grads = _bucket(shapes)
    assert bucket.scale_per_grad == (shapes[0][0] > 100)
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
    bucket, grads = _bucket([(3, 4), (FUSE_MIN_NUMEL,)])
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
