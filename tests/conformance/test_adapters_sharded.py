"""conformance/adapters/sharded.py: the refimpl-sharded adapter drives the engine through the
path its users call (ShardedOptimizer from make_optimizer, public properties only).

In-process gloo world of 1 (no pool): the adapter owns the optimizer, the wrapped object's
optimizer is refimpl's ShardedOptimizer, and one SGD step through it moves the full
parameters exactly as a plain SGD step on the unwrapped model does.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
from torch import nn

from conformance.adapters import registry
from conformance.adapters.protocol import OptimizerSpec, owned
from conformance.spec import WrapOptions


def test_refimpl_sharded_owns_its_optimizer_and_steps_the_users_path(world1):
    from refimpl.sharded import ShardedOptimizer

    adapter = registry.load("refimpl-sharded")
    assert owned(adapter) == {"optimizer"}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    plain = copy.deepcopy(model)
    ctx = SimpleNamespace(group=world1, rank=0, device=torch.device("cpu"))
    wrapped = adapter.wrap(model, ctx, WrapOptions(), optimizer=OptimizerSpec("sgd"))
    assert isinstance(wrapped.optimizer, ShardedOptimizer)
    plain_opt = OptimizerSpec("sgd").build(plain.parameters())

    x = torch.randn(4, 3)
    wrapped(x).sum().backward()
    plain(x).sum().backward()
    grads = wrapped.full_gradients()
    assert all(torch.equal(grads[n], p.grad) for n, p in plain.named_parameters())
    wrapped.optimizer.step()
    plain_opt.step()
    params = wrapped.full_parameters()
    assert all(torch.equal(params[n], p.detach()) for n, p in plain.named_parameters())

    with wrapped.no_sync():  # inside no_sync the suite reads the local p.grad
        wrapped(x).sum().backward()
    assert wrapped.sdp.require_backward_grad_sync
    assert wrapped.full_gradients().keys() == grads.keys()


def test_no_optimizer_scenarios_get_none(world1):
    adapter = registry.load("refimpl-sharded")
    ctx = SimpleNamespace(group=world1, rank=0, device=torch.device("cpu"))
    wrapped = adapter.wrap(nn.Linear(2, 2), ctx, WrapOptions(), optimizer=OptimizerSpec("none"))
    assert wrapped.optimizer is None
