"""Gradient capture by pre-hooks and one buffer per leaf (no RPC needed)."""

from __future__ import annotations

import torch

from refimpl.distributed_autograd import capture
from refimpl.distributed_autograd.local_run import own_buffers


def test_leaf_hook_takes_the_gradient_and_runs_post_hooks_without_writing_grad():
    t = torch.rand(3, requires_grad=True)
    a = t + t
    node = a.grad_fn.next_functions[0][0]
    calls = []
    node.register_hook(lambda grad_inputs, grad_outputs: calls.append(1))
    handle = node.register_prehook(capture.leaf_hook(t))
    with capture.Capture(context_id=7, epoch=0) as cap:
        torch.autograd.backward([a.sum()])
    handle.remove()
    assert t.grad is None, "the capture must not write .grad"
    assert calls == [1], "post hooks of AccumulateGrad run once per run"
    assert torch.equal(cap.leaf_grads()[t], torch.full((3,), 2.0))


def test_leaf_hook_outside_a_run_leaves_plain_autograd_alone():
    t = torch.rand(3, requires_grad=True)
    a = t * 3
    a.grad_fn.next_functions[0][0].register_prehook(capture.leaf_hook(t))
    a.sum().backward()
    assert torch.equal(t.grad, torch.full((3,), 3.0))


def test_own_buffers_copies_shared_keeps_unshared():
    g = torch.rand(2, 3)
    alone = torch.rand(2, 3)
    a, b, c = (torch.rand(2, 3, requires_grad=True) for _ in range(3))
    out = own_buffers({a: g, b: g, c: alone})
    assert out[a].data_ptr() != out[b].data_ptr()
    assert out[a].data_ptr() != g.data_ptr() and out[b].data_ptr() != g.data_ptr()
    assert out[c].data_ptr() == alone.data_ptr(), "an unshared gradient is kept without a copy"
    assert torch.equal(out[a], g) and torch.equal(out[b], g)


def test_own_buffers_makes_dense_contiguous_and_keeps_sparse():
    a, s = torch.rand(2, 3, requires_grad=True), torch.rand(3, requires_grad=True)
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,))
    out = own_buffers({a: torch.ones(3, 2).t(), s: sparse})
    assert out[a].is_contiguous() and out[s].is_sparse


def test_torch_rref_to_here_is_refimpl_aware():
    from torch._C._distributed_rpc import PyRRef

    import refimpl.distributed_autograd.rpc as rpc_mod

    assert PyRRef.to_here is rpc_mod._rref_to_here


def test_a_users_pre_hook_on_the_leaf_node_runs_before_the_capture():
    """The capture hook is kept and goes last on every run: a node pre-hook the user added after
    an earlier run still sees the gradient, what it returns is what is captured, and the node
    carries one capture hook however many runs reached it."""
    from refimpl.distributed_autograd.context import DistAutogradContext
    from refimpl.distributed_autograd.local_run import run_local

    ctx = DistAutogradContext(context_id=9)
    t = torch.rand(3, requires_grad=True)
    a = t * 2
    run_local(ctx, [a.sum()], [torch.ones(())], retain_graph=True)
    seen = []

    def times_ten(grad_outputs):
        seen.append(grad_outputs[0])
        return (grad_outputs[0] * 10,)

    user = a.grad_fn.next_functions[0][0].register_prehook(times_ten)
    run_local(ctx, [a.sum()], [torch.ones(())], retain_graph=True)
    assert seen[0] is not None
    assert torch.equal(ctx.grads[t], torch.full((3,), 2.0 + 20.0))
    assert t.grad is None
    run_local(ctx, [a.sum()], [torch.ones(())], retain_graph=True)
    assert len(user.hooks_dict_ref()) == 2, "one capture hook and the user's"


def test_merge_items_sums_gradients_for_one_send_edge_and_names_missing_edges():
    import pytest

    from refimpl.distributed_autograd.context import DistAutogradContext
    from refimpl.distributed_autograd.functions import send_edge
    from refimpl.distributed_autograd.gradient_messages import _merge_items

    ctx = DistAutogradContext(context_id=5)
    x = torch.rand(2, requires_grad=True)
    first, second = ctx.add_send(send_edge(x * 2), 1), ctx.add_send(send_edge(x * 3), 2)
    def batch(*messages):  # a message: ((send ids, gradients), its credit, its path)
        return [(items, (1, len(messages)), frozenset({0})) for items in messages]

    edges, grads = _merge_items(
        ctx, batch(([first], [torch.ones(2)]), ([second, first], [torch.ones(2), torch.ones(2)]))
    )
    assert len(edges) == 2 and [g.tolist() for g in grads] == [[2.0, 2.0], [1.0, 1.0]]
    edges, grads = _merge_items(ctx, batch(([second, first], [torch.ones(2), 2 * torch.ones(2)])))
    assert edges == [ctx.sends[second][0], ctx.sends[first][0]]
    assert [g.tolist() for g in grads] == [[1.0, 1.0], [2.0, 2.0]]
    with pytest.raises(RuntimeError, match=r"no send edge \[99\] in autograd context 5"):
        _merge_items(ctx, batch(([first, 99], [torch.ones(2), torch.ones(2)])))
