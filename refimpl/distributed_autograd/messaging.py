"""How the engine and the optimizer send their messages: on the channel, or as RPCs.

A message whose tensors are all dense CPU tensors goes on this worker's gradient channel
(channel.py [Note: why a channel of its own]); any other message, and every message while the
channel is switched off (``REFIMPL_DIST_AUTOGRAD_CHANNEL=rpc``), is an RPC through torch's
agent. Either way the sender learns the outcome the same way: ``on_done(answer, None)``, or
``on_done(None, error)`` when the receiver failed, died or timed out.

[Note: answers nobody needs]
``on_done=None`` sends a message that asks for no answer: on the channel the receiver writes
none back and the sender keeps no record of the call; as an RPC its outcome is dropped. The
engine sends that way what only the root waits for: credit returns, and gradient messages to
the root itself. An answer to those could only say the root failed or died, which the root
needs nobody to tell; and it cost the root a write, and the sender a wake-up and a callback,
in the middle of the pass (the last hop of a chain: while the root runs its own last part).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed import rpc

from .context import container
from .frames import carries


def send(dst: int, fn, args: tuple, on_done, tensors=(), cont=None, tail=None) -> None:
    """Run ``fn(*args)`` on worker ``dst``; ``on_done(answer, error)`` follows on another thread
    (``on_done=None``: no answer, see [Note: answers nobody needs]). Raises if the message
    cannot be sent at all (the worker is unknown or unreachable now). ``tensors``: the tensors
    in ``args``. ``tail``: a list of tensors passed as ``fn``'s last argument, which on the
    channel travel without a pickle (frames.py [Note: a frame's tail]). ``cont``: the context
    container when the caller has it (looking it up checks the RPC agent: microseconds a
    message)."""
    channel = (cont if cont is not None else container()).channel
    if tail is not None:
        if (
            channel is not None
            and carries(tail)
            and channel.call(dst, fn, args, on_done, tail)
        ):
            return
        send_rpc(dst, fn, (*args, tail), on_done)
        return
    if channel is not None and carries(tensors) and channel.call(dst, fn, args, on_done):
        return
    # No channel, a tensor it does not carry, or no connection to dst yet (channel.py
    # [Note: connecting never blocks a sender]).
    send_rpc(dst, fn, args, on_done)


def send_rpc(dst: int, fn, args: tuple, on_done) -> None:
    """``send``, always as an RPC through torch's agent (for messages that must keep their
    order behind the agent's other RPCs: lifetime.py [Note: context release])."""
    fut = rpc.rpc_async(dst, fn, args=args)
    if on_done is not None:
        fut.add_done_callback(functools.partial(_rpc_answered, on_done))


def call_async(dst: int, fn, args: tuple) -> torch.futures.Future:
    """``send`` as a future: its value is the answer; it raises ``RuntimeError(error)``."""
    fut: torch.futures.Future = torch.futures.Future()

    def done(answer, error) -> None:
        if error is None:
            fut.set_result(answer)
        else:
            fut.set_exception(RuntimeError(error))

    send(dst, fn, args, done)
    return fut


def _rpc_answered(on_done, fut: torch.futures.Future) -> None:
    try:
        answer = fut.wait()
    except Exception as exc:
        on_done(None, f"{exc}")
        return
    on_done(answer, None)
