"""Capturing gradients during one local run of the distributed backward.

[Note: two ways to capture]
A local run must take the gradient flowing into every leaf's ``AccumulateGrad`` node instead of
letting the node write ``.grad``. torch's engine does it in C++, and runs the node's hooks
itself: its tensor hooks, then its Python pre-hooks, then its post hooks with the gradient.
refimpl has two ways:

- **in C++** (local_run.py ``_capture_edges``): the run asks autograd for the gradients of the
  leaves' nodes, as ``torch.autograd.grad`` does. The nodes do not run; the leaves' tensor hooks
  (``leaf.register_hook``) do. Nothing per leaf happens in Python. Used while no Python hook
  has been put on any autograd node in the process (``_torch_compat.node_hooks_seen``), when
  running the node would show nothing more;
- **by pre-hooks** (below): every ``AccumulateGrad`` node runs, so that a user's node pre-hooks
  and post hooks run as under torch's engine. A registration and a Python call per leaf and
  run: 100 leaves cost ~0.5 ms a run here, which the first way saves. One difference from
  torch's engine remains this way: a leaf's ``register_post_accumulate_grad_hook`` hooks run
  too (with ``.grad`` untouched), since the node runs; torch's engine and the first way do not
  run them.

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
the old one (:func:`install_leaf_hooks`). Outside a distributed run the kept hook returns at
once: a plain ``backward`` through the leaf pays one Python call.
"""

from __future__ import annotations

import functools
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
    """Gradients taken during one local run: per leaf tensor, and per received tensor.

    ``leaves`` is keyed by ``id(leaf)`` (the entry holds the leaf, so the id stays its own):
    a tensor's ``__hash__`` is a Python method, a call per lookup, twice per leaf and run.
    ``recvs`` groups the gradients of received tensors by the worker they came from, as the
    run's messages go out (engine.py).
    """

    __slots__ = ("context_id", "epoch", "leaves", "recvs")

    def __init__(self, context_id: int, epoch: int) -> None:
        self.context_id = context_id
        self.epoch = epoch
        self.leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (leaf, grad)
        self.recvs: dict[int, list[tuple[int, torch.Tensor]]] = {}  # origin -> [(send id, grad)]

    def leaf_grads(self) -> dict[torch.Tensor, torch.Tensor]:
        """The leaves' gradients, keyed by leaf."""
        return dict(self.leaves.values())


    def __enter__(self) -> Capture:
        """``with capture:`` makes it the current thread's run capture."""
        autograd_tls_stash(_TLS_KEY, self)
        return self

    def __exit__(self, *exc) -> None:
        autograd_tls_remove(_TLS_KEY)


_HANDLE_KEY = "refimpl.distributed_autograd.leaf_hook"
_install_lock = threading.Lock()


def install_leaf_hooks(leaves: list[torch.Tensor], nodes: list) -> None:
    """Make the capture hook of each leaf the last pre-hook of its ``AccumulateGrad`` node
    (see [Note: the leaf hook stays, and goes last]). One call per run, not per leaf: a run
    through 100 new nodes registers 100 hooks."""
    for leaf, node in zip(leaves, nodes, strict=True):
        meta = node.metadata
        handle = meta.get(_HANDLE_KEY)
        if handle is not None and _is_last(handle):
            continue  # the common case for a kept node, without the lock
        with _install_lock:  # runs of several contexts may share the leaf (a parameter server)
            handle = meta.get(_HANDLE_KEY)
            if handle is not None and _is_last(handle):
                continue
            # A new registration goes last; the old one is removed only after it, so a
            # backward running meanwhile on another thread always finds one capture hook.
            meta[_HANDLE_KEY] = node.register_prehook(functools.partial(_capture_leaf, leaf))
            if handle is not None:
                handle.remove()


def _is_last(handle) -> bool:
    hooks = hook_dict(handle)
    try:
        return hooks is not None and next(reversed(hooks)) == handle.id
    except (RuntimeError, StopIteration):  # changed by another thread meanwhile: look again
        return False


_EMPTY = (None,)


def _capture_leaf(leaf: torch.Tensor, grad_outputs):
    """A run's pre-hook for ``leaf``'s ``AccumulateGrad`` node (bound to the leaf by a
    ``functools.partial``): take the gradient, let the node run empty. It runs once per leaf in
    every local run (100 leaves: 100 calls), so it reads the capture without a helper call."""
    grad = grad_outputs[0]
    if grad is None or not autograd_tls_has(_TLS_KEY):
        return None
    leaves = autograd_tls_get(_TLS_KEY).leaves
    key = id(leaf)
    previous = leaves.get(key)
    leaves[key] = (leaf, grad) if previous is None else (leaf, previous[1] + grad)
    return _EMPTY


def leaf_hook(leaf: torch.Tensor):
    """The capture pre-hook for ``leaf``'s ``AccumulateGrad`` node (:func:`_capture_leaf`)."""
    return functools.partial(_capture_leaf, leaf)


def capture_recv(node, grads) -> None:
    """Take the gradients flowing into the tensors of one received message, whose
    ``RecvBackward`` is ``node``, to ship to the worker they came from (called by the node's own
    backward: functions.py).

    The node carries its identity as attributes set when the tensors were received: ``origin``,
    ``send_ids`` (one per tensor, in output order), ``context_id`` and the context's ``epoch``
    then.
    """
    if not autograd_tls_has(_TLS_KEY):
        return
    cap = autograd_tls_get(_TLS_KEY)
    got = [(sid, g) for sid, g in zip(node.send_ids, grads, strict=True) if g is not None]
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
    items = cap.recvs.get(node.origin)
    if items is None:
        cap.recvs[node.origin] = got
    else:
        items.extend(got)
