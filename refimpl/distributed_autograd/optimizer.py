"""DistributedOptimizer: step parameters held on remote workers with a context's gradients.

Usage::

    params = [rpc.remote("ps", get_weight), rpc.remote("ps", get_bias)]   # RRefs to params
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    with dist_autograd.context() as context_id:
        loss = dist_autograd.rpc_sync("ps", forward, args=(x,)).sum()
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)     # each owner steps its params with ITS gradients of context_id

One local optimizer is created on each owner worker for the parameters it owns. ``step`` reads
the gradients accumulated on that owner for ``context_id`` (a parameter without one is skipped
by the optimizer, as a parameter with ``grad is None``), and never leaves them in ``.grad``.
Steps on one local optimizer are serialized, so several trainers can share a parameter server.

A step names each local optimizer by a key in its owner's registry, not by its RRef: an RRef
passed from a user to its owner costs the owner a fork-accept message back on every call. The
registry holds local optimizers weakly; the ``DistributedOptimizer``'s RRefs keep them alive.
"""

from __future__ import annotations

import itertools
import threading
import weakref

from torch.distributed import rpc

from .._torch_compat import functional_optimizer
from . import messaging
from .context import container
from .handlers import handler


class _LocalOptimizer:
    """The optimizer of one owner's parameters.

    [Note: functional step]
    Where torch has a functional twin of the optimizer class (SGD, Adam, AdamW, Adagrad,
    Adadelta, RMSprop, Rprop, Adamax: ``_torch_compat.functional_optimizer``), the owner steps
    with it, as torch's ``DistributedOptimizer`` does: the same update from a list of
    gradients, without setting and restoring ``.grad`` around ``Optimizer.step`` and its hook
    machinery (a parameter server steps once per trainer step, holding the GIL its trainers'
    messages wait for). A class without a twin, or arguments the twin does not take, use the
    class itself.
    """

    def __init__(self, optimizer_class, param_rrefs, args, kwargs) -> None:
        self.params = [r.local_value() for r in param_rrefs]
        self.functional = None
        functional = functional_optimizer(optimizer_class)
        if functional is not None:
            try:
                self.functional = functional(self.params, *args, **kwargs)
            except TypeError:  # an argument only the class takes: step with the class
                pass
        self.optim = (
            None if self.functional is not None else optimizer_class(self.params, *args, **kwargs)
        )
        self.lock = threading.Lock()

    def step(self, context_id: int) -> None:
        grads = container().retrieve(context_id).gradients()
        if self.functional is not None:
            with self.lock:
                self.functional.step([grads.get(p) for p in self.params])
            return
        with self.lock:
            saved = [p.grad for p in self.params]
            try:
                for p in self.params:
                    p.grad = grads.get(p)
                self.optim.step()
            finally:
                for p, g in zip(self.params, saved, strict=True):
                    p.grad = g


_registry: weakref.WeakValueDictionary[int, _LocalOptimizer] = weakref.WeakValueDictionary()
_keys = itertools.count()


def _new_local_optimizer(optimizer_class, param_rrefs, args, kwargs):
    """On the owner: a local optimizer, as an RRef (its lifetime) and a registry key."""
    local = _LocalOptimizer(optimizer_class, param_rrefs, args, kwargs)
    key = next(_keys)
    _registry[key] = local
    return rpc.RRef(local), key


@handler
def _local_step(key: int, context_id: int) -> str | None:
    """Step on the owner; an error comes back as its message (not a remote traceback)."""
    try:
        local = _registry.get(key)
        if local is None:
            raise RuntimeError(
                f"local optimizer {key} is gone (its DistributedOptimizer was deleted)"
            )
        local.step(context_id)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


class DistributedOptimizer:
    """``torch.distributed.optim.DistributedOptimizer``'s shape, on refimpl's contexts."""

    def __init__(self, optimizer_class, params_rref, *args, **kwargs) -> None:
        by_owner: dict[int, list] = {}
        owners = {}
        for rref in params_rref:
            owner = rref.owner()
            by_owner.setdefault(owner.id, []).append(rref)
            owners[owner.id] = owner
        futs = [
            rpc.rpc_async(
                owners[w], _new_local_optimizer, args=(optimizer_class, rrefs, args, kwargs)
            )
            for w, rrefs in by_owner.items()
        ]
        created = [f.wait() for f in futs]
        self.remote_optimizers = [rref for rref, _ in created]
        self._steps = [(rref.owner(), key) for rref, key in created]

    def step(self, context_id: int) -> None:
        futs = [
            (owner.id, messaging.call_async(owner.id, _local_step, (key, context_id)))
            for owner, key in self._steps
        ]
        errors = []
        for worker, fut in futs:
            try:
                message = fut.wait()
            except Exception as exc:  # transport failure
                message = f"{exc}"
            if message is not None:
                errors.append(f"Error on Node {worker}: {message}")
        if errors:
            raise RuntimeError("DistributedOptimizer.step failed:\n" + "\n".join(errors))
