"""One local run of a distributed backward pass: the part of the graph on this worker.

A run starts from root tensors (the caller's ``backward``) or from send edges (a gradient
message: gradient_messages.py), walks the graph once to find the leaves and the recv nodes it
reaches, runs autograd over it, and takes the gradients flowing into the leaves (added into the
context, now or after the run's messages went out: engine.py [Note: send first]) and into the
recv nodes (returned, grouped by the worker they came from, for the messages that carry them on).
See capture.py for how the gradients are taken.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .._torch_compat import engine_run_backward, node_hooks_seen, sparse_values
from . import capture
from .capture import install_leaf_hooks
from .context import DistAutogradContext
from .functions import RecvBackward

# The C++ class of leaves' gradient accumulators (exact type checks keep the walk cheap).
_ACCUMULATE_GRAD = type(get_gradient_edge(torch.empty(0, requires_grad=True)).node)


def collect_leaves(start) -> tuple[list[torch.Tensor], list, list]:
    """Leaves requiring grad reachable from ``start`` nodes, their ``AccumulateGrad`` nodes, and
    the reachable recv nodes (the walk stops at both)."""
    seen: set = set()
    stack = list(filter(None, start))  # (nodes are never false; no comprehension frame)
    leaves: list[torch.Tensor] = []
    nodes: list = []
    recvs: list = []
    pop, push, add = stack.pop, stack.append, seen.add  # a run visits every node: no lookups
    while stack:
        node = pop()
        if node in seen:
            continue
        add(node)
        kind = type(node)
        if kind is RecvBackward:
            recvs.append(node)
        elif kind is _ACCUMULATE_GRAD:
            leaves.append(node.variable)
            nodes.append(node)
        else:
            for nxt, _ in node.next_functions:
                if nxt is not None:
                    push(nxt)
    return leaves, nodes, recvs


def own_buffers(grads: dict[torch.Tensor, torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
    """Give every leaf a gradient buffer of its own, dense ones contiguous.

    A backward function may return one tensor as the gradient of two inputs; stored as is, two
    leaves would share (and a later in-place update of one would corrupt the other). Like
    torch's engine, which holds every captured gradient until the pass ends and so never steals
    a shared one, every gradient whose storage another leaf's gradient also uses is copied;
    an unshared one is kept without a copy. Returns ``grads``, the replaced buffers updated in
    place (a dict entry set is a call of the leaf's Python ``__hash__``: only when needed).
    """
    keys: list = []
    shared: set = set()
    if len(grads) > 1:
        seen: set = set()
        strided = torch.strided
        keys = [
            grad.untyped_storage().data_ptr() if grad.layout == strided else _storage_key(grad)
            for grad in grads.values()
        ]
        for key in keys:
            (shared if key in seen else seen).add(key)
    strided = torch.strided
    replaced = []
    for i, (leaf, grad) in enumerate(grads.items()):
        own = grad.detach() if grad.requires_grad else grad
        if own.layout == strided and not own.is_contiguous():
            own = own.contiguous()
        elif shared and keys[i] in shared:
            own = own.clone()
        if own is not grad:
            replaced.append((leaf, own))
    for leaf, own in replaced:
        grads[leaf] = own
    return grads


def _storage_key(grad: torch.Tensor) -> int:
    if grad.is_sparse:
        return sparse_values(grad).untyped_storage().data_ptr()
    if grad.layout != torch.strided:
        return id(grad)
    return grad.untyped_storage().data_ptr()


def _autograd_run(outputs, grad_outputs, retain_graph: bool, inputs=None):
    """``torch.autograd.backward(outputs, grad_outputs)`` without its argument checks; with
    ``inputs`` (gradient edges), ``torch.autograd.grad``'s run instead: the gradients flowing
    into those edges are returned, and their nodes are not run.

    ``torch.autograd.backward`` validates and normalizes every (output, gradient) pair in
    Python (``_make_grads``), which costs microseconds per tensor on every local run; here the
    gradients are the roots' ``ones_like`` or come from autograd on the other side of a send
    edge, so they already match. This calls the engine entry point that ``backward`` and
    ``grad`` end in (torch-private: ``refimpl._torch_compat.engine_run_backward``).
    """
    return engine_run_backward(
        tuple(outputs),
        tuple(grad_outputs),
        retain_graph,
        False,  # create_graph
        () if inputs is None else tuple(inputs),
        allow_unreachable=True,
        accumulate_grad=inputs is None,
    )


def _capture_edges(nodes: list, recvs: list) -> list:
    """The edges a local run asks autograd for (capture.py [Note: two ways to capture]): each
    leaf's ``AccumulateGrad`` ``nodes``, whose gradients torch's engine takes in C++ (running
    the leaves' tensor hooks on them) without running the nodes; and each recv node's edge to
    its context's anchor leaf, which makes autograd still run the recv node (its backward takes
    the gradients to ship)."""
    new = tuple.__new__  # GradientEdge(node, nr) without its Python-level __new__
    inputs = [new(GradientEdge, (node, 0, None)) for node in nodes]
    anchors = set()  # every recv node of a context hangs from the same anchor
    for recv in recvs:
        node, nr = recv.next_functions[0]
        if id(node) not in anchors:
            anchors.add(id(node))
            inputs.append(new(GradientEdge, (node, nr, None)))
    return inputs


def start_node(output):
    """The node a local run starts from: a root tensor's grad_fn, or a send edge's node."""
    return output.node if isinstance(output, GradientEdge) else output.grad_fn


def run_local(
    ctx: DistAutogradContext,
    outputs: list,
    grad_outputs: list[torch.Tensor],
    retain_graph: bool,
    later: list | None = None,
) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """One local run from ``outputs`` (root tensors or send edges): accumulate leaf grads,
    return {origin worker: [(send_id, grad)]}. With ``later`` (a list), the leaf gradients
    are appended to it instead, for the caller to add in after sending ([Note: send first]).

    See capture.py [Note: capture by pre-hooks].
    """
    with ctx.run_lock:
        leaves, nodes, recvs = collect_leaves(list(map(start_node, outputs)))
        if not leaves and not recvs:
            return {}
        cap = capture.Capture(ctx.context_id, ctx.graph_epoch)
        if node_hooks_seen():  # capture.py [Note: two ways to capture]
            # After any pre-hook a user put on the node (capture.py [Note: the leaf hook stays]).
            install_leaf_hooks(leaves, nodes)
            with cap:  # the run's capture, found by the hooks (capture.py)
                _autograd_run(outputs, grad_outputs, retain_graph)
            leaf_grads = cap.leaf_grads()
        else:
            with cap:
                edges = _capture_edges(nodes, recvs)
                grads = _autograd_run(outputs, grad_outputs, retain_graph, edges)
            leaf_grads = {
                leaf: g for leaf, g in zip(leaves, grads[: len(leaves)], strict=True) if g is not None
            }
        if leaf_grads:
            if later is None:
                ctx.accumulate_all(own_buffers(leaf_grads))
            else:
                later.append(leaf_grads)
    return cap.recvs


def accumulate_later(ctx: DistAutogradContext, me: int, later: list) -> None:
    """Add in the leaf gradients of runs whose messages went out first ([Note: send first]),
    then let the readers of the context's gradients go on. A failure here cannot travel with
    the credit any more (it is gone): the context keeps it, and reading its gradients raises."""
    error = None
    try:
        for leaf_grads in later:
            ctx.accumulate_all(own_buffers(leaf_grads))
    except Exception as exc:
        error = f"Error on Node {me}: adding a backward pass's gradients into the context failed: {exc}"
    finally:
        ctx.end_accumulation(error)
