"""The distributed backward engine.

[Note: one backward pass]
``backward(context_id, roots)`` on the caller (worker R):

1. validate the roots (non-empty, scalar, requires grad, has a grad_fn);
2. run the **local part** of the graph once (local_run.py): ``torch.autograd.backward`` from the roots (seeded
   with ones), the gradients flowing into every leaf's ``AccumulateGrad`` and every received
   message's ``RecvBackward`` (one per message: functions.py) taken (capture.py). Leaf
   gradients are accumulated into the context; gradients of received tensors are grouped by the
   worker they came from;
3. send **one message per origin worker** carrying the gradients of all its send edges
   (gradient_messages.py ``_receive_gradients``). That worker runs its local part from those send edges in one
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

from collections.abc import Sequence

import torch
from torch.autograd.profiler import record_function

from .._torch_compat import profiler_enabled
from . import credit as credit_mod
from . import gradient_messages, lifetime, local_run
from .context import container

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
            outbound = local_run.run_local(ctx, roots, grads, local_retain)
        except Exception as exc:
            tracker.returned(credit_mod.FULL, (), (me, f"{exc}"))
        else:
            path = frozenset({me})
            gradient_messages.send_on(ctx, me, me, pass_id, outbound, retain_graph, credit_mod.FULL, path, cont)
        while (batch := tracker.next_work()) is not None:
            with ctx.receive_lock:
                share, path, outbound, error = gradient_messages.run_messages(ctx, me, batch)
            if error is not None or not outbound:
                tracker.returned(share, path, error)
            else:
                gradient_messages.send_on(ctx, me, me, pass_id, outbound, retain_graph, share, path, cont)
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
