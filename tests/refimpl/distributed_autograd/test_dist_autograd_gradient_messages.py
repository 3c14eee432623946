"""A pass's gradient messages (refimpl/distributed_autograd/gradient_messages.py): which ask for
an answer, and a worker that sends on before adding its own gradients in."""

from __future__ import annotations

import threading

import pytest
import torch


def test_only_messages_someone_waits_for_ask_for_an_answer(monkeypatch):
    """A gradient message to another worker asks for an answer (its sender hands the credit
    back if the receiver failed); one to the root, and a credit return, ask for none
    (messaging.py [Note: answers nobody needs])."""
    import importlib

    messages = importlib.import_module("refimpl.distributed_autograd.gradient_messages")
    context = importlib.import_module("refimpl.distributed_autograd.context")
    sent = []

    def send(dst, fn, args, on_done, tensors=(), cont=None, tail=None):
        sent.append((dst, fn.__name__, on_done is None, args[-2] if len(args) == 8 else None))
        if tail is not None:  # the gradients, one per send id (frames.py [Note: a frame's tail])
            assert len(tail) == len(args[4]) and all(t is grad for t in tail)

    monkeypatch.setattr(messages.messaging, "send", send)
    ctx = context.DistAutogradContext(1)
    grad = torch.ones(1)
    outbound = {0: [(0, grad)], 2: [(1, grad)], 3: [(2, grad)]}
    messages.send_on(ctx, 1, 0, 7, outbound, False, (1, 2), frozenset({0, 1}))
    messages._hand_back(1, 0, 7, (1, 4), {1}, None)
    assert sent == [
        (0, "_receive_gradients", True, (1, 6)),  # the root: no answer
        (2, "_receive_gradients", False, (1, 6)),
        (3, "_receive_gradients", False, (1, 6)),
        (0, "_credit_returned", True, None),
    ]
    assert ctx.known_workers == {0, 2, 3}


def test_a_worker_sends_on_before_adding_its_gradients_in_and_readers_wait(monkeypatch):
    """engine.py [Note: send first]: a worker's run sends its received tensors' gradients on
    before adding its leaves' gradients into the context; ``get_gradients`` (and the optimizer's
    read) called meanwhile waits until they are in, and a failure to add them in is raised
    there, not lost."""
    import importlib

    messages = importlib.import_module("refimpl.distributed_autograd.gradient_messages")
    context = importlib.import_module("refimpl.distributed_autograd.context")
    functions = importlib.import_module("refimpl.distributed_autograd.functions")
    cont = context.ContextContainer(1)
    monkeypatch.setattr(messages, "container", lambda: cont)
    ctx = cont.get_or_create(7)
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    (r,) = functions.unpack(ctx, 2, [functions.WireTensor(torch.tensor([5.0, 6.0]), 9)])
    send_id = ctx.add_send(functions.send_edge(r * w), 0)
    events, readers, results = [], [], []  # reader threads; what each read

    def read():
        try:
            results.append(ctx.gradients())
        except RuntimeError as exc:
            results.append(exc)
        events.append("read")

    def send(dst, fn, args, on_done, tensors=(), cont=None, tail=None):
        events.append(("send", dst, [g.tolist() for g in tail], dict(ctx.grads)))
        reader = threading.Thread(target=read)  # a reader while the gradients are not in yet
        reader.start()
        reader.join(0.2)
        events.append(("reader waits", reader.is_alive()))
        readers.append(reader)

    monkeypatch.setattr(messages.messaging, "send", send)

    def receive(accumulate=None):
        if accumulate is not None:
            monkeypatch.setattr(ctx, "accumulate_all", accumulate)
        return messages._receive_gradients(
            0, 3, 7, 0, [send_id], True, (1, 1), frozenset({0}), [torch.ones(2)]
        )

    assert receive() is None
    readers.pop().join(5)
    assert events == [("send", 2, [[1.0, 2.0]], {}), ("reader waits", True), "read"]
    assert torch.equal(results[0][w], torch.tensor([5.0, 6.0]))
    assert ctx.accumulating == 0 and torch.equal(ctx.gradients()[w], torch.tensor([5.0, 6.0]))

    def broken(grads):
        raise RuntimeError("out of memory")

    events.clear()
    receive(broken)
    readers.pop().join(5)
    assert events[1:] == [("reader waits", True), "read"]
    assert "Error on Node 1: adding a backward pass's gradients" in f"{results[-1]}"
    with pytest.raises(RuntimeError, match="Error on Node 1: adding a backward pass's gradients"):
        ctx.gradients()
