"""Send and recv autograd functions, and the walk that records them on RPC payloads.

[Note: send/recv pairs]
When a tensor that requires grad crosses an RPC made in a context, the sender records a
**send edge** and the receiver attaches the tensor to a ``RecvFunction`` node:

    worker A                                   worker B
    x ──> (x's producer, at send time) ═══ (ctx, send_id) ═══> RecvBackward ──> x' (requires grad)

- the send edge is ``torch.autograd.graph.get_gradient_edge(x)``: x's producer node *at send
  time* (a later in-place change of x does not rewire it) — its ``AccumulateGrad`` when x is a
  leaf. The context keeps it under a fresh ``send_id``; when a gradient for that send id comes
  back, the engine runs the local graph from it (autograd accepts edges as roots). No autograd
  node of our own: a Python ``Function`` there would cost a Python call per send in every pass.
- ``RecvFunction.apply(anchor, _Payload(tensors))`` makes the received tensors of one message
  require grad and gives them one grad_fn, shared (so each can be a backward root). The tensors
  themselves are returned, not inputs of the function (an input returned as output would become
  a view, and sparse tensors cannot be views). The node carries ``(origin worker, send ids,
  context, epoch)``; its backward captures the gradients flowing *into* those tensors during a
  distributed backward (see ``capture.py``), which the engine ships to the origin.

[Note: one recv node per message]
Like torch's ``RecvRpcBackward``, one node serves every tensor of a message: autograd runs it
once per local run, after every use of any of its tensors, with a gradient per tensor (``None``
for one that got none). A node per tensor cost a Python call per received tensor in every run
(100 small tensors: 0.36 ms of a 1.2 ms run), and an ``apply`` per tensor when receiving. As
with torch's node, and with any autograd node of several outputs: a pre-hook on the node gets
one gradient per tensor of the message, and a hook on a received tensor that the graph does not
use is called with ``None`` when the node runs for its siblings. A call's args and kwargs are
one message.

On the wire a recorded tensor travels as a detached tensor inside a ``WireTensor`` marker.
Nested tuples, lists (and namedtuples) and dicts are walked; other objects pass unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .capture import capture_recv
from .context import DistAutogradContext


class _Payload:
    """Carries the received tensors into ``RecvFunction.forward`` without making them inputs."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors


class RecvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, payload):  # noqa: D102
        ctx.set_materialize_grads(False)  # no gradient stays None: nothing to ship
        return tuple(payload.tensors)

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        # In a distributed backward's local run: take the gradients to ship (capture.py). In a
        # plain local backward through a received tensor: nothing, gradients of received
        # tensors flow back only through distributed backward.
        capture_recv(ctx, grads)
        return None, None


RecvBackward = RecvFunction._backward_cls


def _recv_apply(node, *grads):
    """What autograd calls to run a recv node: ``RecvFunction.backward``'s work, called
    directly. A Python ``Function``'s node runs ``BackwardCFunction.apply``, which finds the
    user's ``backward`` (``_get_user_fn``) and then calls it: two Python frames more, on every
    local run of every hop, for a class whose ``backward`` is known here."""
    capture_recv(node, grads)
    return _NO_INPUT_GRADS


_NO_INPUT_GRADS = (None, None)  # the anchor's and the payload's: nothing flows on
RecvBackward.apply = _recv_apply
# torch's node names (``node.name()`` of a Python node is its class's name). Autograd's profiler
# records every node it runs under its name, so a run through a recv node shows up as torch's.
RECV_NAME = RecvBackward.__name__ = "torch::distributed::autograd::RecvRpcBackward"
SEND_NAME = "torch::distributed::autograd::SendRpcBackward"


class SendRpcBackward:
    """The send function of one outgoing message, as torch's ``_send_functions()`` shows it: its
    ``next_functions`` are the ``(node, input_nr)`` send edges recorded for the message's
    tensors requiring grad, in payload order.

    Not an autograd node (see [Note: send/recv pairs]): the engine starts local runs from the
    edges themselves, and this object only lets tools and torch's tests read the graph.
    """

    __slots__ = ("next_functions",)

    def __init__(self, edges: list[GradientEdge]) -> None:
        self.next_functions = tuple((e.node, e.output_nr) for e in edges)

    @staticmethod
    def name() -> str:
        return SEND_NAME

    def __repr__(self) -> str:
        return f"<SendRpcBackward of {len(self.next_functions)} edges>"


class WireTensor:
    """A tensor that requires grad, in flight: its data and the sender's send id."""

    __slots__ = ("tensor", "send_id")

    def __init__(self, tensor: torch.Tensor, send_id: int) -> None:
        self.tensor = tensor
        self.send_id = send_id

    def __getstate__(self):
        return (self.tensor, self.send_id)

    def __setstate__(self, state):
        self.tensor, self.send_id = state

    def __repr__(self) -> str:
        return f"WireTensor(send_id={self.send_id}, shape={tuple(self.tensor.shape)})"


def _map(obj: Any, fn) -> Any:
    """Apply ``fn`` to every tensor/WireTensor in nested tuples, lists, namedtuples, dicts."""
    if isinstance(obj, (torch.Tensor, WireTensor)):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [_map(o, fn) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_map(o, fn) for o in obj]
    if isinstance(obj, dict):
        return type(obj)((k, _map(v, fn)) for k, v in obj.items())
    return obj


def send_edge(t: torch.Tensor) -> GradientEdge:
    """The gradient edge of ``t``'s producer now (its ``AccumulateGrad`` when ``t`` is a leaf),
    holding that part of the graph alive (``ownership_token``: a Python node's object alone
    does not)."""
    if t.layout == torch.strided:
        return get_gradient_edge(t)
    # get_gradient_edge goes through a view, and sparse tensors have no views: an op instead.
    with torch.enable_grad():
        owner = (t * 1).grad_fn
    node, output_nr = owner.next_functions[0]
    return GradientEdge(node, output_nr, ownership_token=owner)


def pack(ctx: DistAutogradContext, dst: int, obj: Any) -> tuple[Any, int]:
    """Replace every tensor requiring grad in ``obj`` (one message) by a ``WireTensor`` and
    record its send edge, and the message's ``SendRpcBackward``.

    Returns the packed object and the number of sends recorded. Outside grad mode nothing
    is recorded (like a forward under ``torch.no_grad()``).
    """
    if not torch.is_grad_enabled():
        return obj, 0
    edges: list[GradientEdge] = []

    def one(t):
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            return t
        edge = send_edge(t)
        edges.append(edge)
        return WireTensor(t.detach(), ctx.add_send(edge, dst))

    packed = _map(obj, one)
    if edges:  # one send function per message that records anything, as torch's
        ctx.add_send_function(SendRpcBackward(edges))
    return packed, len(edges)


def _wires(obj: Any, out: list) -> None:
    """Append every ``WireTensor`` in ``obj`` to ``out``, in ``_map``'s order."""
    if isinstance(obj, WireTensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _wires(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _wires(o, out)


def unpack(ctx: DistAutogradContext, origin: int, obj: Any) -> Any:
    """Attach the ``WireTensor``s in ``obj`` to one ``RecvFunction`` for ``origin`` and their
    send ids (see [Note: one recv node per message])."""
    wires: list[WireTensor] = []
    _wires(obj, wires)
    if not wires:
        return obj
    tensors, seen = [], set()
    for w in wires:  # each output its own tensor object, as autograd wants
        t = w.tensor if id(w.tensor) not in seen else w.tensor.detach()
        seen.add(id(t))
        tensors.append(t)
    with torch.enable_grad():
        received = RecvFunction.apply(ctx.anchor, _Payload(tensors))
    node = received[0].grad_fn
    node.origin, node.send_ids = origin, [w.send_id for w in wires]
    node.context_id, node.epoch = ctx.context_id, ctx.graph_epoch
    ctx.add_recv_function(node, origin)
    outputs = iter(received)
    return _map(obj, lambda t: next(outputs) if isinstance(t, WireTensor) else t)
