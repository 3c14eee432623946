"""The functions a channel call may name, and how they answer (channel.py).

[Note: handlers by name]
A call names its function. Pickled, a function is found by importing its module on both sides:
the costliest part of a gradient message's pickle, a few microseconds each way, paid on the
critical path of every hop. The engine's, the optimizer's and the fetch handlers are registered
here by name instead (:func:`handler`): a frame carries the name as a string, looked up in a dict
on arrival. Any other function travels pickled, as before. Every worker imports the modules
that register them (``refimpl.distributed_autograd`` imports them all), so a name always
resolves; one that does not becomes the call's error.

A handler may also declare that its empty answer can wait (:func:`defers_empty_answer`): an
empty answer tells its caller nothing the caller waits for, and a non-empty one is only given
when it sent its caller nothing. Such an answer rides in a later message to the caller, or is
written a little later (channel.py [Note: an answer that rides along], owed.py [Note: answers
that wait]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

# Read by the channel on every message, without a call each (a call costs microseconds on a
# thread that just woke up): name -> handler, handler -> name, the handlers that defer.
BY_NAME: dict[str, Callable] = {}
NAMES: dict[Callable, str] = {}
DEFERRING: set = set()


def handler(fn: Callable) -> Callable:
    """Register ``fn`` as a channel handler sent by name; returns ``fn`` (a decorator)."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    BY_NAME[name] = fn
    NAMES[fn] = name
    return fn


def defers_empty_answer(fn: Callable) -> Callable:
    """Declare that ``fn``'s empty answer may wait, and that ``fn`` answers empty whenever it
    has sent its caller a message, which it does only as its last act that can fail or send
    (the engine's gradient handler, in gradient_messages.py, then only adds gradients in:
    engine.py [Note: send first]); returns ``fn`` (a decorator)."""
    DEFERRING.add(fn)
    return fn


def by_name(name: str) -> Callable:
    """The handler registered as ``name``; else one that raises why (the call's answer)."""
    fn = BY_NAME.get(name)
    if fn is None:
        return functools.partial(_unknown, name)
    return fn


def _unknown(name: str, *args):
    raise RuntimeError(f"no channel handler {name!r} on this worker: import its module here")
