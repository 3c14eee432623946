"""RPC wrappers that record send edges and recv functions (mirroring ``torch.distributed.rpc``).

``rpc_sync`` / ``rpc_async`` / ``remote`` take the same arguments as their torch namesakes.
Inside a :func:`~refimpl.distributed_autograd.context`, every tensor requiring grad in
``args``/``kwargs`` (nested tuples, lists, dicts) is recorded as a send edge and travels
detached; the callee runs ``func`` inside the same context id (created there on demand) with
those tensors attached to recv functions, and tensors requiring grad in the return value make
the same trip back. Outside a context they are plain torch RPCs.

``remote`` keeps the result on the owner (its graph lives in the owner's context); fetch it with
autograd recorded through :func:`to_here` or torch's own ``RRef.to_here()``, or pass the RRef to
another ``rpc_sync``.

[Note: torch's RRef.to_here]
A user who swaps engines keeps calling ``rref.to_here()``: torch's C++ fetch knows nothing of
refimpl's contexts and would hand back a detached copy, a silent wrong gradient. So importing
this module replaces ``RRef.to_here`` by a method that, while a refimpl context is current on
the calling thread, fetches through :func:`to_here` (recording the send/recv pair) and
otherwise calls torch's own. Inside TorchScript, ``to_here`` is torch's C++ and is not
intercepted.

TorchScript functions are valid targets, as with torch: they cannot be pickled, so they travel
by qualified name and the callee looks up its own compiled copy (the defining module must be
imported there, as torch requires too).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch
from torch.distributed import rpc
from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT

from .._torch_compat import find_script_function, rref_class
from . import lifetime, messaging
from .context import _as_current, container, current_context
from .frames import carries
from .functions import pack, unpack
from .handlers import handler

PyRRef = rref_class()


def _worker_id(to) -> int:
    if isinstance(to, rpc.WorkerInfo):
        return to.id
    return rpc.get_worker_info(to).id


class _ScriptTarget:
    """A TorchScript function in flight: its qualified name (see [Note: torch's RRef.to_here])."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def resolve(self):
        fn = find_script_function(self.name)
        if fn is None:
            raise RuntimeError(
                f"TorchScript function {self.name} is not compiled on this worker: import the "
                "module that defines it here too"
            )
        return fn


def _call_in_context(context_id: int, origin: int, func, args, kwargs, send_back: bool):
    """Callee side: run ``func`` in context ``context_id``, recording recvs and sends."""
    if isinstance(func, _ScriptTarget):
        func = func.resolve()
    ctx = container().get_or_create(context_id)
    args, kwargs = unpack(ctx, origin, (args, kwargs))  # one message: one recv node
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


def _reach(ctx, dst: int, by_rpc: bool) -> None:
    """Before a message of context ``ctx`` goes to worker ``dst``: send the graph releases
    still owed (lifetime.py [Note: deferred release]), and count ``dst`` as reached. The callee
    creates the context even when no tensor requiring grad travels (its answer may carry one):
    it must be released there too. ``by_rpc``: the message goes through torch's agent (then so
    does the context's release to ``dst``: lifetime.py [Note: context release])."""
    lifetime.drain_releases(ctx)
    with ctx.lock:
        ctx.known_workers.add(dst)
        if by_rpc:
            ctx.rpc_workers.add(dst)


def _prepare(to, func, args, kwargs):
    ctx = current_context()
    me = container().worker_id
    dst = _worker_id(to)
    _reach(ctx, dst, by_rpc=True)
    if isinstance(func, torch.jit.ScriptFunction):
        func = _ScriptTarget(func.qualified_name)
    call = (tuple(args) if args is not None else (), dict(kwargs) if kwargs is not None else {})
    (packed_args, packed_kwargs), _ = pack(ctx, dst, call)  # one message: one send function
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


def to_here(rref: rpc.RRef, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Fetch an RRef's value; inside a context, tensors requiring grad come with recv functions
    (see [Note: fetch by key])."""
    ctx = current_context()
    if ctx is None:
        return _torch_to_here(rref, timeout)
    by_key = timeout == UNSET_RPC_TIMEOUT and not rref.is_owner()
    key = _key_of(rref) if by_key else None
    if key is None:
        key, value = rpc_sync(rref.owner(), _local_value, args=(rref, by_key), timeout=timeout)
        if key is not None:
            _remember_key(rref, key)
        return value
    dst = rref.owner().id
    _reach(ctx, dst, by_rpc=False)
    me = container().worker_id
    packed = messaging.call_async(dst, _value_by_key, (ctx.context_id, me, key)).wait()
    return unpack(ctx, dst, packed)


# [Note: fetch by key]
# torch pickles an RRef passed to its owner through its fork protocol (the owner answers with
# a message of its own), and a Python RPC cannot take the gradient channel; so a parameter
# server's trainer paid two such round trips per step for its ``to_here`` calls. The first
# fetch of an RRef inside a context goes as an RPC carrying the RRef; when its value is a dense
# CPU tensor (what the channel carries), the owner answers with the value and the key it keeps
# that tensor under, weakly, one key per tensor however many RRefs and fetches name it; later
# fetches of that RRef send only the key, over the channel (messaging.py). The tensor lives as
# long as its OwnerRRef, which lives as long as this user's RRef, so a key in use always
# resolves. Any other value, a fetch by the owner itself, and every fetch with an explicit
# timeout go as an RPC carrying the RRef each time.
_keys_lock = threading.RLock()  # re-entrant: a finalizer may run inside it (garbage collection)
_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # user: RRef -> (container, key)
_owned: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # owner: key -> tensor
_key_by_id: dict[int, int] = {}  # owner: id(tensor) -> its key, while the tensor lives
_next_key = itertools.count()


def _local_value(rref: rpc.RRef, want_key: bool = False):
    """On the owner: (the key of the value, or None; the value)."""
    value = rref.local_value()
    if not want_key or not isinstance(value, torch.Tensor) or not carries((value,)):
        return None, value
    with _keys_lock:
        key = _key_by_id.get(id(value))
        if key is None or _owned.get(key) is not value:
            key = next(_next_key)
            _owned[key] = value
            _key_by_id[id(value)] = key
            weakref.finalize(value, _forget, id(value), key)
    return key, value


def _forget(value_id: int, key: int) -> None:
    with _keys_lock:
        if _key_by_id.get(value_id) == key:
            del _key_by_id[value_id]


@handler
def _value_by_key(context_id: int, origin: int, key: int):
    """On the owner: the value kept under ``key``, its tensors recorded in ``context_id``."""
    value = _owned.get(key)
    if value is None:
        raise RuntimeError(f"RRef value {key} is gone from this worker (its RRef was deleted)")
    packed, _ = pack(container().get_or_create(context_id), origin, value)
    return packed


def _key_of(rref) -> int | None:
    with _keys_lock:
        entry = _keys.get(rref)
    if entry is None:
        return None
    cont, key = entry
    return key if cont() is container() else None  # an RRef of an earlier RPC world: no


def _remember_key(rref, key: int) -> None:
    try:
        with _keys_lock:
            _keys[rref] = (weakref.ref(container()), key)
    except TypeError:  # an RRef type that cannot be held weakly: fetch it the first way
        pass


_torch_to_here = PyRRef.to_here


def _rref_to_here(self, timeout: float = UNSET_RPC_TIMEOUT):
    """torch's ``RRef.to_here``, recording autograd inside a refimpl context."""
    if current_context() is None:
        return _torch_to_here(self, timeout)
    return to_here(self, timeout)


_rref_to_here.__doc__ = (_torch_to_here.__doc__ or "") + (
    "\n\nInside a refimpl.distributed_autograd context the fetch records the autograd edge "
    "(see refimpl/distributed_autograd/rpc.py [Note: torch's RRef.to_here])."
)
PyRRef.to_here = _rref_to_here
