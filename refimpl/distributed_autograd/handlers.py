"""The functions a channel call may name, and how they answer (channel.py).

[Note: handlers by name]
A call names its function. Pickled, a function is found by importing its module on both sides:
the costliest part of a gradient message's pickle, a few microseconds each way, paid on the
critical path of every hop. The engine's, the optimizer's and the fetch handlers are registered
here by name instead (:func:`handler`): a frame carries the name as a string, looked up in a dict
on arrival. Any other function travels pickled, as before. Every worker imports the modules
that register them (``refimpl.distributed_autograd`` imports them all), so a name always
resolves; one that does not becomes the call's error.

A handler may also declare that it answers by forwarding (:func:`answers_by_forwarding`): its
answer is empty once it has sent a message to its caller, which it does only as its last act,
so the answer can ride in that message (channel.py [Note: an answer that rides along]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

_BY_NAME: dict[str, Callable] = {}
_NAMES: dict[Callable, str] = {}
_FORWARDERS: set = set()


def handler(fn: Callable) -> Callable:
    """Register ``fn`` as a channel handler sent by name; returns ``fn`` (a decorator)."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    _BY_NAME[name] = fn
    _NAMES[fn] = name
    return fn


def answers_by_forwarding(fn: Callable) -> Callable:
    """Declare ``fn`` a handler whose answer is always empty once it has sent a message to its
    caller, which it does only as its last act; returns ``fn`` (a decorator)."""
    _FORWARDERS.add(fn)
    return fn


def name_of(fn: Callable):
    """What a frame carries for ``fn``: its registered name, else ``fn`` itself (pickled)."""
    return _NAMES.get(fn, fn)


def by_name(name: str) -> Callable:
    """The handler registered as ``name``; else one that raises why (the call's answer)."""
    fn = _BY_NAME.get(name)
    if fn is None:
        return functools.partial(_unknown, name)
    return fn


def forwards(fn: Callable) -> bool:
    """Whether ``fn`` answers by forwarding."""
    return fn in _FORWARDERS


def _unknown(name: str, *args):
    raise RuntimeError(f"no channel handler {name!r} on this worker: import its module here")
