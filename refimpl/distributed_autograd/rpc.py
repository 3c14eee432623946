"""RPC wrappers that record send/recv functions (mirroring ``torch.distributed.rpc``).

``rpc_sync`` / ``rpc_async`` / ``remote`` take the same arguments as their torch namesakes.
Inside a :func:`~refimpl.distributed_autograd.context`, every tensor requiring grad in
``args``/``kwargs`` (nested tuples, lists, dicts) is recorded as a send function and travels
detached; the callee runs ``func`` inside the same context id (created there on demand) with
those tensors attached to recv functions, and tensors requiring grad in the return value make
the same trip back. Outside a context they are plain torch RPCs.

``remote`` keeps the result on the owner (its graph lives in the owner's context); fetch it with
autograd recorded through :func:`to_here`, or pass the RRef to another ``rpc_sync``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import rpc
from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT

from .context import _as_current, container, current_context
from .functions import pack, unpack


def _worker_id(to) -> int:
    if isinstance(to, rpc.WorkerInfo):
        return to.id
    return rpc.get_worker_info(to).id


def _call_in_context(context_id: int, origin: int, func, args, kwargs, send_back: bool):
    """Callee side: run ``func`` in context ``context_id``, recording recvs and sends."""
    ctx = container().get_or_create(context_id)
    args = unpack(ctx, origin, args)
    kwargs = unpack(ctx, origin, kwargs)
    with _as_current(ctx):
        result = func(*args, **kwargs)
    if not send_back:
        return result
    packed, _ = pack(ctx, origin, result)
    return packed


def _remote_call(context_id, origin, func, args, kwargs):
    return _call_in_context(context_id, origin, func, args, kwargs, send_back=True)


def _remote_create(context_id, origin, func, args, kwargs):
    return _call_in_context(context_id, origin, func, args, kwargs, send_back=False)


def _prepare(to, func, args, kwargs):
    ctx = current_context()
    ctx.drain_releases()  # see engine.py [Note: deferred release]
    me = container().worker_id
    dst = _worker_id(to)
    packed_args, _ = pack(ctx, dst, tuple(args) if args is not None else ())
    packed_kwargs, _ = pack(ctx, dst, dict(kwargs) if kwargs is not None else {})
    return ctx, dst, (ctx.context_id, me, func, packed_args, packed_kwargs)


def rpc_sync(to, func, args=None, kwargs=None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """``torch.distributed.rpc.rpc_sync`` recording send/recv functions in the current context."""
    if current_context() is None:
        return rpc.rpc_sync(to, func, args=args, kwargs=kwargs, timeout=timeout)
    ctx, dst, call_args = _prepare(to, func, args, kwargs)
    result = rpc.rpc_sync(to, _remote_call, args=call_args, timeout=timeout)
    return unpack(ctx, dst, result)


def rpc_async(to, func, args=None, kwargs=None, timeout: float = UNSET_RPC_TIMEOUT):
    """``torch.distributed.rpc.rpc_async``; the future's value has recv functions attached."""
    if current_context() is None:
        return rpc.rpc_async(to, func, args=args, kwargs=kwargs, timeout=timeout)
    ctx, dst, call_args = _prepare(to, func, args, kwargs)
    fut = rpc.rpc_async(to, _remote_call, args=call_args, timeout=timeout)

    def attach(done: torch.futures.Future):
        with torch.enable_grad():
            return unpack(ctx, dst, done.value())

    return fut.then(attach)


def remote(to, func, args=None, kwargs=None, timeout: float = UNSET_RPC_TIMEOUT) -> rpc.RRef:
    """``torch.distributed.rpc.remote``; arguments are recorded, the result stays on the owner."""
    if current_context() is None:
        return rpc.remote(to, func, args=args, kwargs=kwargs, timeout=timeout)
    _, _, call_args = _prepare(to, func, args, kwargs)
    return rpc.remote(to, _remote_create, args=call_args, timeout=timeout)


def _local_value(rref: rpc.RRef):
    return rref.local_value()


def to_here(rref: rpc.RRef, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Fetch an RRef's value; inside a context, tensors requiring grad come with recv functions."""
    if current_context() is None:
        return rref.to_here(timeout) if timeout != UNSET_RPC_TIMEOUT else rref.to_here()
    return rpc_sync(rref.owner(), _local_value, args=(rref,), timeout=timeout)
