"""Send/recv recording on payloads, without RPC (one process plays both sides)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch.autograd.graph import GradientEdge

from refimpl.distributed_autograd.context import ContextContainer
from refimpl.distributed_autograd.functions import (
    RecvBackward,
    SendRpcBackward,
    WireTensor,
    pack,
    send_edge,
    unpack,
)
from refimpl.distributed_autograd.local_run import run_local

Pair = namedtuple("Pair", "a b")


def test_pack_records_one_send_per_tensor_requiring_grad_in_nested_structures():
    ctx = ContextContainer(0).new_context()
    x = torch.randn(3, requires_grad=True)
    plain = torch.randn(3)
    obj = (x, [plain, {"k": x * 2}], Pair(x, 7), "s")
    packed, count = pack(ctx, 1, obj)
    assert count == 3
    assert isinstance(packed[0], WireTensor) and not packed[0].tensor.requires_grad
    assert packed[1][0] is plain
    assert isinstance(packed[1][1]["k"], WireTensor)
    assert type(packed[2]) is Pair and packed[2].b == 7 and packed[3] == "s"
    assert sorted(ctx.sends) == [0, 1, 2]
    # the send edges: x's AccumulateGrad (twice: a leaf sent twice) and x * 2's MulBackward0
    edges = [ctx.sends[i][0] for i in range(3)]
    assert all(isinstance(e, GradientEdge) and ctx.sends[i][1] == 1 for i, e in enumerate(edges))
    assert type(edges[0].node).__name__ == "AccumulateGrad" and edges[0].node.variable is x
    assert type(edges[1].node).__name__ == "MulBackward0"
    assert ctx.known_workers == {1}


def test_nothing_recorded_under_no_grad():
    ctx = ContextContainer(0).new_context()
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        packed, count = pack(ctx, 1, (x,))
    assert count == 0 and packed[0] is x and not ctx.sends


def test_unpack_attaches_recv_functions():
    ctx = ContextContainer(1).new_context()
    wire = WireTensor(torch.arange(3.0), send_id=4)
    out = unpack(ctx, 0, {"a": [wire], "b": 2})
    t = out["a"][0]
    assert t.requires_grad and isinstance(t.grad_fn, RecvBackward)
    assert (t.grad_fn.origin, t.grad_fn.send_ids, t.grad_fn.context_id) == (0, [4], ctx.context_id)
    assert torch.equal(t, torch.arange(3.0)) and out["b"] == 2
    assert ctx.known_workers == {0}


def test_one_recv_node_per_message_routes_each_gradient_to_its_send_id():
    """A message's tensors share one node (torch's RecvRpcBackward is per message too); each
    gradient still goes back under its own send id, and an unused tensor sends nothing."""
    sender = ContextContainer(0).new_context()
    receiver = ContextContainer(1).get_or_create(sender.context_id)
    a, b, c = (torch.randn(3, requires_grad=True) for _ in range(3))
    packed, count = pack(sender, 1, {"x": [a * 1, b * 2], "y": (c * 3, 5)})
    assert count == 3
    out = unpack(receiver, 0, packed)
    (x0, x1), (y0, five) = out["x"], out["y"]
    assert x0.grad_fn is x1.grad_fn is y0.grad_fn and five == 5
    assert isinstance(x0.grad_fn, RecvBackward) and len(x0.grad_fn.send_ids) == 3
    outbound = run_local(receiver, [(x0 * 10 + y0 * 1000).sum()], [torch.ones(())], False)
    by_id = dict(outbound[0])
    assert len(by_id) == 2  # x1 unused: no gradient for its send id
    for sid, scale in zip(x0.grad_fn.send_ids[::2], (10.0, 1000.0), strict=True):
        torch.testing.assert_close(by_id[sid], torch.full((3,), scale))
        send_output, _ = sender.sends[sid]
        assert run_local(sender, [send_output], [by_id[sid]], retain_graph=True) == {}
    torch.testing.assert_close(sender.grads[a], torch.full((3,), 10.0))
    torch.testing.assert_close(sender.grads[c], torch.full((3,), 3000.0))
    assert b not in sender.grads


def test_send_functions_one_per_message_with_the_recorded_edges_as_next_functions():
    """torch's ``_send_functions()``: one send function per message that records anything;
    its next_functions are the message's send edges in payload order, under torch's names."""
    ctx = ContextContainer(0).new_context()
    a, b = torch.ones(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    pack(ctx, 1, ((a, torch.ones(2), b), {}))  # one message: args and kwargs together
    pack(ctx, 2, (torch.ones(2),))  # nothing requires grad: no send function
    pack(ctx, 1, (a * 3,))
    sends = ctx._send_functions()
    assert len(sends) == 2 and all(isinstance(f, SendRpcBackward) for f in sends.values())
    first, second = sends.values()
    assert first.name() == "torch::distributed::autograd::SendRpcBackward"
    assert [(n.name(), nr) for n, nr in first.next_functions] == [
        ("torch::autograd::AccumulateGrad", 0)
    ] * 2
    assert [n.variable for n, _ in first.next_functions] == [a, b]
    ((mul, nr),) = second.next_functions
    assert (mul.name(), nr) == ("MulBackward0", 0)
    assert mul.next_functions[0][0].variable is a
    ctx.release_graph()  # the graph is dropped: so are the send functions holding it
    assert ctx._send_functions() == {}


def test_recv_functions_are_the_recv_nodes_under_torch_name():
    sender = ContextContainer(0).new_context()
    receiver = ContextContainer(1).get_or_create(sender.context_id)
    x = torch.ones(2, requires_grad=True)
    (t1, t2), _ = pack(sender, 1, (x * 1, x * 2))
    r1, r2 = unpack(receiver, 0, (t1, t2))
    recvs = receiver._recv_functions()
    assert list(recvs.values()) == [r1.grad_fn] and r1.grad_fn is r2.grad_fn
    assert r1.grad_fn.name() == "torch::distributed::autograd::RecvRpcBackward"
    nodes = (r1 + r2).grad_fn.next_functions  # torch's test: both edges reach the one node
    assert [(n.name(), nr) for n, nr in nodes] == [
        ("torch::distributed::autograd::RecvRpcBackward", 0),
        ("torch::distributed::autograd::RecvRpcBackward", 1),
    ]
    # A message without tensors requiring grad records no recv node.
    unpack(receiver, 0, (torch.ones(1),))
    assert len(receiver._recv_functions()) == 1
    receiver.release_graph()
    assert receiver._recv_functions() == {}


def test_loopback_send_recv_routes_gradients():
    """Sender graph -> wire -> receiver graph; the receiver's run yields the sender's grads."""
    sender = ContextContainer(0).new_context()
    receiver = ContextContainer(1).get_or_create(sender.context_id)
    w = torch.randn(3, requires_grad=True)
    h = w * 3
    packed, _ = pack(sender, 1, (h,))
    (x,) = unpack(receiver, 0, packed)
    loss = (x * x).sum()
    outbound = run_local(receiver, [loss], [torch.ones(())], retain_graph=False)
    [(send_id, grad)] = outbound[0]
    torch.testing.assert_close(grad, 2 * h.detach())
    send_output, _ = sender.sends[send_id]
    assert run_local(sender, [send_output], [grad], retain_graph=True) == {}
    torch.testing.assert_close(sender.grads[w], 6 * h.detach())
    assert w.grad is None  # never written to .grad


def test_in_place_after_send_uses_the_graph_as_sent():
    ctx = ContextContainer(0).new_context()
    w = torch.randn(3, requires_grad=True)
    h = w * 2
    pack(ctx, 1, (h,))
    h.mul_(5)  # later in-place change does not rewire the recorded send
    send_output, _ = ctx.sends[0]
    run_local(ctx, [send_output], [torch.ones(3)], retain_graph=True)
    torch.testing.assert_close(ctx.grads[w], torch.full((3,), 2.0))


def test_wire_tensor_pickles():
    import pickle

    wt = pickle.loads(pickle.dumps(WireTensor(torch.ones(2), 9)))
    assert wt.send_id == 9 and torch.equal(wt.tensor, torch.ones(2))
    assert "send_id=9" in repr(wt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_are_accumulated_per_leaf(dtype):
    ctx = ContextContainer(0).new_context()
    w = torch.ones(2, dtype=dtype, requires_grad=True)
    for _ in range(2):
        run_local(ctx, [(w * 3).sum()], [torch.ones((), dtype=dtype)], retain_graph=False)
    assert torch.equal(ctx.grads[w], torch.full((2,), 6.0, dtype=dtype))


class _Scale(torch.autograd.Function):
    """``x * 1``, a Python node whose backward scales the gradient by ``factor`` (``None``: no
    gradient at all)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return (None if ctx.factor is None else grad * ctx.factor), None


def test_send_edge_keeps_a_python_node_alive_after_the_tensor_is_gone():
    import gc

    w = torch.ones(3, requires_grad=True)
    y = _Scale.apply(w, 3.0)
    edge = send_edge(y)
    del y
    gc.collect()
    torch.autograd.backward([edge], [torch.ones(3)])
    torch.testing.assert_close(w.grad, torch.full((3,), 3.0))


def test_send_edge_of_a_sparse_leaf_is_its_accumulator():
    s = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,)).requires_grad_()
    edge = send_edge(s)
    assert type(edge.node).__name__ == "AccumulateGrad" and edge.node.variable is s
    torch.autograd.backward([edge], [torch.sparse_coo_tensor([[0]], [5.0], (3,))])
    assert s.grad.is_sparse and torch.equal(s.grad.to_dense(), torch.tensor([5.0, 0.0, 0.0]))


def test_a_recv_node_that_gets_no_gradient_is_not_checked_against_the_run():
    """A tensor received in one context may sit in another context's graph on a path that gives
    it no gradient: the shared node runs with only Nones, which is nothing to ship, not an
    error (one node per tensor never ran then)."""
    sender, receiver = ContextContainer(0), ContextContainer(1)
    first = sender.new_context()
    a = torch.randn(2, requires_grad=True)
    packed, _ = pack(first, 1, (a * 1,))
    (x,) = unpack(receiver.get_or_create(first.context_id), 0, packed)
    second = receiver.get_or_create(sender.new_context().context_id)
    w = torch.randn(2, requires_grad=True)
    loss = (_Scale.apply(x, None) * w).sum()
    assert run_local(second, [loss], [torch.ones(())], retain_graph=False) == {}
    torch.testing.assert_close(second.grads[w], x.detach())
    # With a gradient, the same crossing is still refused.
    with pytest.raises(RuntimeError, match="received in autograd context"):
        run_local(second, [(x * w).sum()], [torch.ones(())], retain_graph=False)
