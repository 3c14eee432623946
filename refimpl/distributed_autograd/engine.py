"""The distributed backward engine.

[Note: one backward pass]
``backward(context_id, roots)`` on the caller (worker R):

1. validate the roots (non-empty, scalar, requires grad, has a grad_fn);
2. run the **local part** of the graph once: ``torch.autograd.backward`` from the roots (seeded
   with ones), the gradients flowing into every leaf's ``AccumulateGrad`` and every received
   message's ``RecvBackward`` (one per message: functions.py) taken (capture.py). Leaf
   gradients are accumulated into the context; gradients of received tensors are grouped by the
   worker they came from;
3. send **one message per origin worker** carrying the gradients of all its send edges
   (``_receive_gradients``). That worker runs its local part from those send edges in one
   ``torch.autograd.backward`` call, accumulates, and sends on to *its* origins in turn. The
   messages are one-way: the root knows the pass is over when all of its credit has come back
   (credit.py [Note: credit]) — so when ``backward`` returns, every worker the graph reaches
   has finished, without a chain of answers retracing the chain of messages;
4. unless ``retain_graph``, tell every reached worker to drop the send edges of the
   context (off the critical path: lifetime.py [Note: deferred release]); the gradients stay
   in each worker's context until it is released.

[Note: several messages for one worker]
A worker can receive gradients for its send edges in several messages of one pass (fan-out
to two workers, a round trip A→B→A after A's root run). Each local run starts from the send
edges its messages name; runs of one context are serialized on that worker (``run_lock``)
and the graph is kept (``retain_graph=True``) while the pass may still reach it. Gradients are
linear in the incoming vector, so summing the runs' results is exact math; the cost is that a
node reachable from send edges named in k separate runs executes k times. Two rules keep k
small: messages that arrive while a run is going on are run together, once, when their turn
comes ([Note: merged messages]); and messages to the root wait until they hold all the
credit still out, so that a fan-out's answers meet the root's shared nodes in one run
(credit.py [Note: the root's own messages]). torch's FAST mode always executes such a node
once, but must then assume every send function will receive a gradient, and hangs when one
does not (torch's ``test_backward_unused_send_function``). Here an unused send edge simply
never gets a message and the pass completes.

[Note: send first]
A worker that gets gradients runs its part, sends the gradients of its received tensors on,
and only then adds its leaves' gradients into the context (own buffers, then a sum into what
is there: on the chain's middle worker the second run adds a 256x256 weight gradient, ~70 us
of memory traffic, which the next hop no longer waits for). torch's engine does the same by
its order of execution: a leaf's gradient accumulator is an old node, run after the recv
node of this pass that sends. What the order must not change: when ``backward`` returns,
every worker's gradients are in. A run marks its context (``begin_accumulation``) before any
of its credit leaves the worker, and the readers of the gradients (``get_gradients``,
``DistributedOptimizer.step``) wait until every marked run is added in. Runs add in in the
order they ran (a run's mark waits for the run before to finish adding in), so the sums come
out the same from pass to pass. Adding in can only
fail where memory runs out; such a failure is kept by the context, and reading its gradients
raises it. The root's own runs add in at once: its ``backward`` waits anyway.

Errors: a failure on worker N (an exception in its local run, or a message its sender could
not deliver to it) hands that branch's credit back to the root with ``(N, message)``; the root
raises ``RuntimeError("Error on Node N: message")`` once all credit is back. The pass
bookkeeping is undone on every worker whatever happens.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.autograd.profiler import record_function

from .._torch_compat import engine_run_backward, node_hooks_seen, profiler_enabled, sparse_values
from . import capture, lifetime, messaging
from . import credit as credit_mod
from .capture import install_leaf_hooks
from .context import DistAutogradContext, container
from .functions import SEND_NAME, RecvBackward
from .handlers import defers_empty_answer, handler

# torch's profiler scope of a distributed backward (see [Note: profiler scopes]).
BACKWARD_NAME = "torch::distributed::autograd::backward"


# roots ------------------------------------------------------------------------------------------
def validate_roots(roots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if roots is None or isinstance(roots, torch.Tensor):
        raise TypeError(  # "incompatible function arguments": torch's (pybind11's) wording
            "backward(): incompatible function arguments: roots must be a list of scalar "
            f"tensors, got {type(roots).__name__}; pass e.g. [loss]"
        )
    roots = list(roots)
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    for i, root in enumerate(roots):
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"root {i} is a {type(root).__name__}, not a tensor")
        if not root.requires_grad:
            raise RuntimeError(f"requires_grad not set on root {i}: every root must require grad")
        if root.numel() != 1:
            raise RuntimeError(
                f"root {i} of shape {tuple(root.shape)} is not a scalar, "
                "all roots need to be scalar"
            )
        if root.grad_fn is None:
            raise RuntimeError(
                f"root {i} does not have a valid gradient function (it is a leaf tensor); "
                "roots must be computed from tensors that require grad"
            )
    return roots


# the local part of the graph ----------------------------------------------------------------------
# The C++ class of leaves' gradient accumulators (exact type checks keep the walk cheap).
_ACCUMULATE_GRAD = type(get_gradient_edge(torch.empty(0, requires_grad=True)).node)


def _collect_leaves(start) -> tuple[list[torch.Tensor], list, list]:
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


def _own_buffers(grads: dict[torch.Tensor, torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
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


def _start_node(output):
    """The node a local run starts from: a root tensor's grad_fn, or a send edge's node."""
    return output.node if isinstance(output, GradientEdge) else output.grad_fn


def _run_local(
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
        leaves, nodes, recvs = _collect_leaves(list(map(_start_node, outputs)))
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
                ctx.accumulate_all(_own_buffers(leaf_grads))
            else:
                later.append(leaf_grads)
    return cap.recvs


def _accumulate_later(ctx: DistAutogradContext, me: int, later: list) -> None:
    """Add in the leaf gradients of runs whose messages went out first ([Note: send first]),
    then let the readers of the context's gradients go on. A failure here cannot travel with
    the credit any more (it is gone): the context keeps it, and reading its gradients raises."""
    error = None
    try:
        for leaf_grads in later:
            ctx.accumulate_all(_own_buffers(leaf_grads))
    except Exception as exc:
        error = f"Error on Node {me}: adding a backward pass's gradients into the context failed: {exc}"
    finally:
        ctx.end_accumulation(error)


# messaging: one-way gradient messages, credit back to the root (credit.py [Note: credit]) ----
def _send_on(
    ctx, me: int, root: int, pass_id: int, outbound, retain_graph: bool, share, path, cont=None
):
    """Send a local run's gradients to their origin workers, splitting ``share`` of the credit
    between the messages; a run that sends nothing hands its credit back to the root.

    A message to the root asks for no answer: the answer only tells the sender to hand the
    message's credit back when its receiver failed, and the receiver is the root itself
    ([Note: answers nobody needs])."""
    if not outbound:
        _hand_back(me, root, pass_id, share, path, None)
        return
    dsts = list(outbound)
    with ctx.lock:
        ctx.known_workers.update(dsts)
    part = share if len(dsts) == 1 else credit_mod.split(share, len(dsts))
    for dst in dsts:
        items = outbound[dst]
        send_ids, grads = map(list, zip(*items, strict=True))  # no Python frame per message
        args = (root, pass_id, ctx.context_id, me, send_ids, retain_graph, part, path)
        if dst == root:
            answered = None
        else:
            answered = functools.partial(_delivered, me, root, pass_id, part, path, dst)
        try:  # the gradients as the message's tail: frames.py [Note: a frame's tail]
            messaging.send(dst, _receive_gradients, args, answered, cont=cont, tail=grads)
        except Exception as exc:
            _hand_back(me, root, pass_id, part, path | {dst}, (dst, f"{exc}"))


def _delivered(me, root, pass_id, part, path, dst, answer, error: str | None) -> None:
    """A gradient message was answered. A failed delivery (dead worker, timeout) hands that
    message's credit back with the error; an answer carrying credit (the receiver's part ended
    there and this worker is the root) returns it."""
    if error is not None:
        _hand_back(me, root, pass_id, part, path | {dst}, (dst, error))
        return
    if answer is not None:
        credit, reached, error = answer
        credit_mod.registry.returned(pass_id, credit, reached, error)


def _hand_back(me: int, root: int, pass_id: int, credit, reached, error) -> None:
    """Return ``credit`` to the root: a message without an answer (only the root waits for it)."""
    if root == me:
        credit_mod.registry.returned(pass_id, credit, reached, error)
        return
    try:
        messaging.send(root, _credit_returned, (pass_id, credit, reached, error), None)
    except Exception:
        pass  # the root is unreachable from here: nobody else could tell it either


def _end_of_branch(me: int, root: int, sender: int, pass_id: int, credit, reached, error):
    """Hand back the credit of a branch that ends here: in the answer to the gradient message
    when its sender is the root (no extra message: the parameter-server and fan-out shapes),
    else by a message of its own to the root."""
    if sender == root:
        return (credit, reached, error)
    _hand_back(me, root, pass_id, credit, reached, error)
    return None


# RPC entry points --------------------------------------------------------------------------------
@handler
def _credit_returned(pass_id: int, credit, reached, error) -> None:
    credit_mod.registry.returned(pass_id, credit, reached, error)


@handler
@defers_empty_answer  # its empty answer waits for a message to the sender (owed.py)
def _receive_gradients(
    root: int,
    pass_id: int,
    context_id: int,
    sender: int,
    send_ids: list[int],
    retain_graph: bool,
    share,
    path,
    grads: list[torch.Tensor],
):
    """Gradients for some of this worker's send edges arrived (``grads[i]`` for the edge
    ``send_ids[i]``): run the local part, send on.

    Answers (the sender's delivery check) once the local run is done and its gradients are on
    their way: ``None``, or ``(credit, reached, error)`` when the branch ends here and the
    sender is the root; the pass's end is the root's business (credit.py [Note: credit]).
    Messages of one pass that arrive while another is being run here are run together, once
    (see [Note: merged messages]).
    """
    cont = container()
    me = cont.worker_id
    message = ((send_ids, grads), share, path)
    if root == me:  # the waiting backward runs it: credit.py [Note: the root's own messages]
        tracker = credit_mod.registry.get(pass_id)  # its backward() counts the pass here
        if tracker is not None:
            tracker.deliver(message, share)
        return None
    try:
        ctx = cont.pass_started_in(context_id)
    except Exception as exc:
        return _end_of_branch(me, root, sender, pass_id, share, path | {me}, (me, f"{exc}"))
    # The sender is in ctx.known_workers already: it is where the send edges were sent to.
    key = (root, pass_id)
    if ctx.receive_lock.acquire(blocking=False):  # nothing runs here: run now, with any queued
        with ctx.lock:
            batch = [*ctx.inbox.pop(key, ()), message]  # in arrival order
    else:
        with ctx.lock:
            ctx.inbox.setdefault(key, []).append(message)
        ctx.receive_lock.acquire()
        with ctx.lock:
            batch = ctx.inbox.pop(key, [])
    later: list = []  # the run's leaf gradients, added in after its messages go ([Note: send first])
    try:
        if not batch:  # run already, with a message that came before it
            cont.pass_finished(context_id)
            return None
        share, path, outbound, error = _run_messages(ctx, me, batch, later)
        if later:
            ctx.begin_accumulation()  # before any credit leaves: the pass cannot end without it
    finally:
        ctx.receive_lock.release()
    # Finished here before anything is sent on: once the root has all its credit back, no
    # worker still counts this pass (debug info).
    cont.pass_finished(context_id)
    try:
        if error is not None or not outbound:
            return _end_of_branch(me, root, sender, pass_id, share, path, error)
        _send_on(ctx, me, root, pass_id, outbound, retain_graph, share, path, cont)
        return None
    finally:
        if later:  # marked above: readers wait for it, whenever the credit arrives
            _accumulate_later(ctx, me, later)


def _run_messages(ctx: DistAutogradContext, me: int, batch, later: list | None = None):
    """Run the local part for one or more gradient messages of a pass (caller holds
    ``ctx.receive_lock``): (their credit, their paths joined with this worker, outbound, error).
    ``later``: see ``_run_local``."""
    if len(batch) == 1:
        _, share, path = batch[0]
        path = path if me in path else path | {me}
    else:
        share = functools.reduce(credit_mod.add, (credit for _, credit, _ in batch))
        path = frozenset({me}).union(*(p for _, _, p in batch))
    try:
        if profiler_enabled():
            with record_function(SEND_NAME):
                edges, grads = _merge_items(ctx, batch)
        else:
            edges, grads = _merge_items(ctx, batch)
        outbound = _run_local(ctx, edges, grads, True, later)
    except Exception as exc:
        return share, path, {}, (me, f"{exc}")
    return share, path, outbound, None


_first = operator.itemgetter(0)


def _merge_items(ctx: DistAutogradContext, batch: list) -> tuple[list, list]:
    """The send edges and gradients of one or more messages (a batch of ``(items, credit,
    path)``); gradients for one edge summed.

    [Note: merged messages]
    When several gradient messages of one pass reach a worker close together (a fan-out's
    answers), the first starts a local run at once and the others wait for it; when their turn
    comes, every message that has arrived by then is taken and run as one: the nodes they share
    execute once, not once per message. Their credit is summed and goes on with the run's
    messages (credit is additive: credit.py), and their paths are joined.
    """
    if len(batch) == 1:  # one message names each of its edges once
        send_ids, grads = batch[0][0]
    else:
        by_id: dict[int, torch.Tensor] = {}
        for (ids, message_grads), _, _ in batch:
            for send_id, grad in zip(ids, message_grads, strict=True):
                previous = by_id.get(send_id)
                by_id[send_id] = grad if previous is None else previous + grad
        send_ids, grads = list(by_id), list(by_id.values())
    with ctx.lock:  # (map: no Python frame per message)
        entries = list(map(ctx.sends.get, send_ids))
    if None in entries:
        missing = [sid for sid, e in zip(send_ids, entries, strict=True) if e is None]
        raise RuntimeError(
            f"no send edge {missing} in autograd context {ctx.context_id}: the graph was "
            "released by a previous backward(retain_graph=False)"
        )
    return list(map(_first, entries)), grads


# public ------------------------------------------------------------------------------------------
def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass of ``context_id`` from ``roots``.

    Gradients are accumulated into the context on every worker the graph reaches
    (``get_gradients(context_id)`` on that worker), never into ``.grad``. Returns when all
    those workers have finished. A failure anywhere raises ``RuntimeError("Error on Node N:
    ...")`` here.

    [Note: profiler scopes]
    While torch's autograd profiler records on the calling thread, the pass shows up under
    torch's names: the whole call as ``torch::distributed::autograd::backward``; every run of a
    recv node as ``...RecvRpcBackward`` (autograd records each node under its name:
    functions.py); and each local run of received gradients as ``...SendRpcBackward``, around
    handing them to the send edges (torch: one event per send function that runs; here one per
    run, which may serve several). With the profiler off this costs one flag read per backward
    and per run of received gradients.
    """
    if profiler_enabled():
        with record_function(BACKWARD_NAME):
            _backward(context_id, roots, retain_graph)
    else:
        _backward(context_id, roots, retain_graph)


def _backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool) -> None:
    if not isinstance(context_id, int) or isinstance(context_id, bool):
        raise TypeError(
            "backward(): incompatible function arguments: context_id must be an int, got "
            f"{type(context_id).__name__}"
        )
    cont = container()
    ctx = cont.retrieve(context_id)
    roots = validate_roots(roots)
    lifetime.drain_releases(ctx)  # see lifetime.py [Note: deferred release]
    me = cont.worker_id
    cont.pass_started(context_id)
    pass_id, tracker = credit_mod.registry.start(me)
    try:
        try:
            # The root run is the only local run of this pass when this worker sent nothing in
            # the context: then it may free the graph as plain autograd would.
            with ctx.lock:
                local_retain = retain_graph or bool(ctx.sends)
            grads = [torch.ones_like(r) for r in roots]
            outbound = _run_local(ctx, roots, grads, local_retain)
        except Exception as exc:
            tracker.returned(credit_mod.FULL, (), (me, f"{exc}"))
        else:
            path = frozenset({me})
            _send_on(ctx, me, me, pass_id, outbound, retain_graph, credit_mod.FULL, path, cont)
        while (batch := tracker.next_work()) is not None:
            with ctx.receive_lock:
                share, path, outbound, error = _run_messages(ctx, me, batch)
            if error is not None or not outbound:
                tracker.returned(share, path, error)
            else:
                _send_on(ctx, me, me, pass_id, outbound, retain_graph, share, path, cont)
        if not retain_graph:
            lifetime.end_pass_on(ctx, tracker.reached, me)
    finally:
        credit_mod.registry.finish(pass_id)
        cont.pass_finished(context_id)
    if tracker.error is not None:
        node, message = tracker.error
        raise RuntimeError(f"Error on Node {node}: {message}")


def _get_debug_info() -> dict[str, int]:
    """``num_current_backward_passes`` and ``num_autograd_contexts`` on this worker."""
    return container().debug_info()


debug_info = _get_debug_info
