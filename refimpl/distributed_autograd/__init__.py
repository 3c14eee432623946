"""Distributed autograd over ``torch.distributed.rpc``: refimpl's own engine.

Mirrors ``torch.distributed.autograd`` + ``torch.distributed.rpc``::

    import refimpl.distributed_autograd as dist_autograd

    with dist_autograd.context() as context_id:
        y = dist_autograd.rpc_sync("worker1", torch.mul, args=(x, w))
        dist_autograd.backward(context_id, [y.sum()])
        grads = dist_autograd.get_gradients(context_id)

Modules: ``context`` (ids, thread-local current context, container), ``lifetime`` (opening
and releasing contexts and graphs on every worker), ``functions`` (send/recv
autograd functions and payload packing), ``capture`` (taking gradients in a local run),
``engine`` (backward, cleanup, debug info), ``credit`` (when a pass is over), ``messaging``
(sending a message: channel or RPC), ``channel`` (the direct gradient channel between workers),
``connection`` (one of its TCP connections), ``frames`` (its wire format), ``rpc`` (recording
wrappers), ``optimizer`` (DistributedOptimizer).
"""

from .context import (
    _current_context,
    _retrieve_context,
    current_context_id,
    get_gradients,
)
from .engine import _get_debug_info, backward, debug_info
from .lifetime import _get_max_id, _new_context, _release_context, context
from .optimizer import DistributedOptimizer
from .rpc import remote, rpc_async, rpc_sync, to_here

__all__ = [
    "DistributedOptimizer",
    "backward",
    "context",
    "current_context_id",
    "debug_info",
    "get_gradients",
    "remote",
    "rpc_async",
    "rpc_sync",
    "to_here",
    "_current_context",
    "_get_debug_info",
    "_get_max_id",
    "_new_context",
    "_release_context",
    "_retrieve_context",
]
