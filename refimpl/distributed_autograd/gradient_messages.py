"""A distributed backward pass's gradient messages: one-way, with credit back to the root.

A local run's gradients for received tensors go to the workers they came from, one message per
worker (:func:`send_on`); a worker that gets one runs its part of the graph and sends on in turn
(``_receive_gradients``, a channel handler), and the branch's credit goes back to the root where
the pass ends (credit.py [Note: credit]). The whole pass: engine.py [Note: one backward pass].
"""

from __future__ import annotations

import functools
import operator

import torch
from torch.autograd.profiler import record_function

from .._torch_compat import profiler_enabled
from . import credit as credit_mod
from . import local_run, messaging
from .context import DistAutogradContext, container
from .functions import SEND_NAME
from .handlers import defers_empty_answer, handler


def send_on(
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


# channel handlers --------------------------------------------------------------------------------
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
        share, path, outbound, error = run_messages(ctx, me, batch, later)
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
        send_on(ctx, me, root, pass_id, outbound, retain_graph, share, path, cont)
        return None
    finally:
        if later:  # marked above: readers wait for it, whenever the credit arrives
            local_run.accumulate_later(ctx, me, later)


def run_messages(ctx: DistAutogradContext, me: int, batch, later: list | None = None):
    """Run the local part for one or more gradient messages of a pass (caller holds
    ``ctx.receive_lock``): (their credit, their paths joined with this worker, outbound, error).
    ``later``: see ``run_local``."""
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
        outbound = local_run.run_local(ctx, edges, grads, True, later)
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
