"""One local run (refimpl/distributed_autograd/local_run.py): both ways to capture give the same
run, and a hook on any node switches to the pre-hook capture."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("hooks_seen", [False, True], ids=["in-cpp", "by-pre-hooks"])
def test_both_ways_to_capture_give_the_same_run(monkeypatch, hooks_seen):
    """A local run captures the same leaf and recv gradients whichever way it captures
    (capture.py [Note: two ways to capture]): the leaves' tensor hooks apply, ``.grad`` stays
    untouched, and a leaf sent as is (its node is the run's start) gets the message's gradient."""
    import importlib

    local_run = importlib.import_module("refimpl.distributed_autograd.local_run")
    context = importlib.import_module("refimpl.distributed_autograd.context")
    functions = importlib.import_module("refimpl.distributed_autograd.functions")
    monkeypatch.setattr(local_run, "node_hooks_seen", lambda: hooks_seen)
    ctx = context.DistAutogradContext(5)
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    b = torch.tensor([3.0, 4.0], requires_grad=True)
    b.register_hook(lambda grad: grad * 10)  # a tensor hook: both ways run it
    (r,) = functions.unpack(ctx, 2, [functions.WireTensor(torch.tensor([5.0, 6.0]), 9)])
    loss = (r * w + b).sum() + (w * w).sum()
    recvs = local_run.run_local(ctx, [loss], [torch.ones(())], retain_graph=False)
    assert set(ctx.grads) == {w, b}
    assert torch.equal(ctx.grads[w], torch.tensor([5.0, 6.0]) + 2 * w.detach())
    assert torch.equal(ctx.grads[b], torch.tensor([10.0, 10.0]))
    assert list(recvs) == [2] and recvs[2][0][0] == 9
    assert torch.equal(recvs[2][0][1], w.detach())
    assert w.grad is None and b.grad is None
    # a send edge that is a leaf's own node: the gradient goes straight to the leaf
    edge = torch.autograd.graph.get_gradient_edge(w)
    assert local_run.run_local(ctx, [edge], [torch.tensor([1.0, 1.0])], retain_graph=True) == {}
    assert torch.equal(ctx.grads[w], torch.tensor([6.0, 7.0]) + 2 * w.detach())


def test_node_hooks_switch_to_the_pre_hook_capture_and_run():
    """Once a Python hook sits on any autograd node, runs capture by pre-hooks, so that a post
    hook on a leaf's node runs as under torch's engine (a fresh process: the switch is for
    good)."""
    import subprocess
    import sys

    code = """
import importlib
import torch
from refimpl._torch_compat import node_hooks_seen
context = importlib.import_module("refimpl.distributed_autograd.context")
local_run = importlib.import_module("refimpl.distributed_autograd.local_run")
assert not node_hooks_seen()
ctx = context.DistAutogradContext(1)
w = torch.ones(2, requires_grad=True)
local_run.run_local(ctx, [(w * 3).sum()], [torch.ones(())], retain_graph=False)
assert not node_hooks_seen()
calls = []
loss = (w * 3).sum()
loss.grad_fn.next_functions[0][0].next_functions[0][0].register_hook(lambda *a: calls.append(1))
assert node_hooks_seen()
local_run.run_local(ctx, [loss], [torch.ones(())], retain_graph=False)
assert calls == [1] and torch.equal(ctx.grads[w], torch.full((2,), 6.0)) and w.grad is None
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
