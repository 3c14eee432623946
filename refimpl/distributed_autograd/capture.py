"""Capturing gradients during one local run of the distributed backward.

[Note: capture by pre-hooks]
A local run is a plain ``torch.autograd.backward`` over this worker's part of the graph. Its
frontier has two kinds of nodes, and each takes the gradient flowing into it:

- ``AccumulateGrad`` of a leaf: a pre-hook stores the gradient in the run's :class:`Capture` and
  replaces it by ``None``, so that the node executes (its post hooks run, as under torch's
  engine) but writes nothing to ``.grad`` (``AccumulateGrad`` ignores an undefined gradient);
- ``RecvBackward`` of a received message's tensors: its own backward stores their gradients
  (after any pre-hook a user put on the node), to be shipped to the worker they came from
  (:func:`capture_recv`; a pre-hook there would cost a second Python call per run).

The run's capture is found through the autograd thread-local state that torch propagates to
its device threads (``_torch_compat.autograd_tls_stash``), so a hook on another thread's run,
or on a plain local ``loss.backward()``, leaves the gradient alone (several contexts may share
a leaf concurrently: each run's hook sees only its own capture).

[Note: the leaf hook stays, and goes last]
A leaf's capture hook is registered once, on the first run that reaches its node, and kept
(registering and removing it on every run cost ~8 us per leaf: 0.8 ms per pass with 100
leaves; a leaf whose graph is built anew every iteration still gets a new node, and a new
registration, each time). A pre-hook a user registers on the node must still run *before* the
capture and see the gradient, so a run that finds the capture hook no longer last in the node's
pre-hook dict (which autograd runs in insertion order) registers it again, last, and removes
the old one (:func:`install_leaf_hook`). Outside a distributed run the kept hook returns at
once: a plain ``backward`` through the leaf pays one Python call.
"""

from __future__ import annotations

import threading

import torch

from .._torch_compat import (
    autograd_tls_get,
    autograd_tls_has,
    autograd_tls_remove,
    autograd_tls_stash,
    hook_dict,
)

_TLS_KEY = "refimpl.distributed_autograd.capture"


class Capture:
    """Gradients taken during one local run: per leaf tensor, and per received tensor."""

    __slots__ = ("context_id", "epoch", "leaves", "recvs")

    def __init__(self, context_id: int, epoch: int) -> None:
        self.context_id = context_id
        self.epoch = epoch
        self.leaves: dict[torch.Tensor, torch.Tensor] = {}
        self.recvs: list[tuple[int, int, torch.Tensor]] = []  # (origin, send id, grad)


def _current() -> Capture | None:
    if autograd_tls_has(_TLS_KEY):
        return autograd_tls_get(_TLS_KEY)
    return None


class active:
    """``with active(capture):`` — make ``capture`` the current thread's run capture."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture

    def __enter__(self) -> Capture:
        autograd_tls_stash(_TLS_KEY, self.capture)
        return self.capture

    def __exit__(self, *exc) -> None:
        autograd_tls_remove(_TLS_KEY)


_HANDLE_KEY = "refimpl.distributed_autograd.leaf_hook"
_install_lock = threading.Lock()


def install_leaf_hook(leaf: torch.Tensor, node) -> None:
    """Make the capture hook of ``leaf`` the last pre-hook of its ``AccumulateGrad`` ``node``
    (see [Note: the leaf hook stays, and goes last])."""
    meta = node.metadata
    if _is_last(meta.get(_HANDLE_KEY)):
        return  # the common case, without the lock
    with _install_lock:  # runs of several contexts may share the leaf (a parameter server)
        handle = meta.get(_HANDLE_KEY)
        if _is_last(handle):
            return
        # A new registration goes last; the old one is removed only after it, so a backward
        # running meanwhile on another thread always finds one capture hook.
        meta[_HANDLE_KEY] = node.register_prehook(leaf_hook(leaf))
        if handle is not None:
            handle.remove()


def _is_last(handle) -> bool:
    if handle is None:
        return False
    hooks = hook_dict(handle)
    try:
        return hooks is not None and next(reversed(hooks)) == handle.id
    except (RuntimeError, StopIteration):  # changed by another thread meanwhile: look again
        return False


_EMPTY = (None,)


def leaf_hook(leaf: torch.Tensor):
    """A run's pre-hook for ``leaf``'s ``AccumulateGrad`` node: take the gradient, let the node
    run empty. It runs once per leaf in every local run (100 leaves: 100 calls), so it reads
    the capture without a helper call."""

    def hook(grad_outputs):
        grad = grad_outputs[0]
        if grad is None or not autograd_tls_has(_TLS_KEY):
            return None
        leaves = autograd_tls_get(_TLS_KEY).leaves
        previous = leaves.get(leaf)
        leaves[leaf] = grad if previous is None else previous + grad
        return _EMPTY

    return hook


def capture_recv(node, grads) -> None:
    """Take the gradients flowing into the tensors of one received message, whose
    ``RecvBackward`` is ``node``, to ship to the worker they came from (called by the node's own
    backward: functions.py).

    The node carries its identity as attributes set when the tensors were received: ``origin``,
    ``send_ids`` (one per tensor, in output order), ``context_id`` and the context's ``epoch``
    then.
    """
    cap = _current()
    if cap is None:
        return
    origin = node.origin
    got = [(origin, sid, g) for sid, g in zip(node.send_ids, grads, strict=True) if g is not None]
    if not got:  # nothing flows back through these tensors: nothing to ship, nothing to check
        return
    if node.context_id != cap.context_id:
        raise RuntimeError(
            f"a tensor received in autograd context {node.context_id} is part of the graph of "
            f"a backward in context {cap.context_id}"
        )
    if node.epoch != cap.epoch:
        raise RuntimeError(
            "Trying to backward through the distributed graph a second time: it was "
            "released by a previous backward(retain_graph=False) in context "
            f"{node.context_id}; pass retain_graph=True to the first backward"
        )
    cap.recvs.extend(got)
