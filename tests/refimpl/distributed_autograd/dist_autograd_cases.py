"""Compositions run three ways: locally, through refimpl's RPC, through torch's RPC.

Each case is ``case(call, *tensors) -> scalar loss`` where ``call(to, fn, args)`` is the RPC
(or a local call). Functions that run on other workers and call further take the mode name, so
the nested hop uses the same machinery.
"""

from __future__ import annotations

import torch

# a backward that raises (torch's own test's error), shared with the suite's compositions
from conformance.models.dist_autograd import fail_in_backward


def call_for(mode: str):
    if mode == "local":
        return lambda to, fn, args: fn(*args)
    if mode == "refimpl":
        import refimpl.distributed_autograd as dist_autograd

        return lambda to, fn, args: dist_autograd.rpc_sync(to, fn, args=args)
    if mode == "torch":
        from torch.distributed import rpc

        return lambda to, fn, args: rpc.rpc_sync(to, fn, args=args)
    raise ValueError(mode)


def tensors(seed):
    """A case's leaves ``x, w`` (float64, from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 4, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(4, 4, generator=g, dtype=torch.float64).requires_grad_()
    return x, w


def assert_grads(name, got, leaves, expected):
    """``got`` (a context's gradients) holds ``expected[i]`` for ``leaves[i]``, and nothing for a None."""
    for i, (t, e) in enumerate(zip(leaves, expected, strict=True)):
        if e is None:
            assert t not in got, f"{name}: tensor {i} unused yet has a gradient {got.get(t)}"
        else:
            assert t in got, f"{name}: tensor {i} has no gradient in the context"
            torch.testing.assert_close(got[t], e, msg=lambda m, i=i: f"{name}: tensor {i}: {m}")


# functions executed on remote workers ---------------------------------------------------------
def hop_to_2(mode, x):
    """On worker1: compute, call worker2, compute again (chain 0 -> 1 -> 2)."""
    h = x * 2 + 1
    z = call_for(mode)("worker2", torch.mul, (h, h))
    return z.sin() + h


def back_to_0(mode, x, w):
    """On worker1: call back into worker0 (round trip 0 -> 1 -> 0)."""
    y = x.exp() * w
    z = call_for(mode)("worker0", torch.mul, (y, y))
    return z + y


def nested_structures(pair, items, named):
    a, b = pair
    return {"sum": (a * b, [a + items[0]]), "cos": named["t"].cos(), "n": 3}


def ignore_second(x, y):
    return x * 3


# cases -----------------------------------------------------------------------------------------
def simple(mode, x, w):
    return call_for(mode)("worker1", torch.mul, (x, w)).sum()


def chain(mode, x, w):
    y = call_for(mode)("worker1", hop_to_2, (mode, x * w))
    return (y * w).sum()


def fan_out(mode, x, w):
    call = call_for(mode)
    h = x * w
    a = call("worker1", torch.tanh, (h,))
    b = call("worker2", torch.sigmoid, (h,))
    return (a * b).sum() + h.sum()


def sent_twice(mode, x, w):
    call = call_for(mode)
    a = call("worker1", torch.mul, (x, w))
    b = call("worker1", torch.add, (x, a))
    c = call("worker2", torch.mul, (x, x))
    return (a + b + c).sum()


def round_trip(mode, x, w):
    y = call_for(mode)("worker1", back_to_0, (mode, x, w))
    return (y * x).sum()


def structures(mode, x, w):
    out = call_for(mode)("worker1", nested_structures, ((x, w), [x * 2], {"t": w}))
    assert out["n"] == 3
    prod, (s,) = out["sum"]
    return (prod * s).sum() + out["cos"].sum()


def self_call(mode, x, w):
    return call_for(mode)("worker0", torch.mul, (x, w)).sum()


def unused_leaf(mode, x, w):
    # w is sent but the callee ignores it: its gradient is absent (not zero) in every mode.
    return call_for(mode)("worker1", ignore_second, (x, w)).sum()


class Counted(torch.autograd.Function):
    """Identity whose backward counts its calls (``COUNTED``)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        COUNTED[0] += 1
        return grad


COUNTED = [0]


def counted_fan_out(mode, x, w):
    """worker0 sends h to workers 1 and 2; both answers flow back through ``Counted``."""
    call = call_for(mode)
    h = Counted.apply(x * w)
    return call("worker1", torch.mul, (h, w)).sum() + call("worker2", torch.mul, (h, h)).sum()


CASES = [simple, chain, fan_out, sent_twice, round_trip, structures, self_call, unused_leaf]


def multi_roots(mode, x, w):
    call = call_for(mode)
    r1 = call("worker1", torch.add, (x, w)).sum()
    r2 = call("worker2", torch.mul, (x, w)).sum()
    r3 = call("worker1", torch.cos, (x,)).sum()
    r4 = (x * w).sum()
    return [r1, r2, r3, r4]


def fail_deeper(x):
    """On worker1: forward to worker2 where the backward will fail."""
    import refimpl.distributed_autograd as dist_autograd

    return dist_autograd.rpc_sync("worker2", fail_in_backward, args=(x + 1,)) * 2


# probing the engine from inside a backward ------------------------------------------------------
RECORDED: list = []


class RecordDebugInfo(torch.autograd.Function):
    """Identity whose backward records the worker's debug info while the pass runs."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import refimpl.distributed_autograd as dist_autograd

        RECORDED.append(dist_autograd._get_debug_info())
        return grad


def record_in_backward(x):
    return RecordDebugInfo.apply(x) * 2


def recorded():
    return list(RECORDED)


def rref_value_grad(rref, context_id: int):
    """On an RRef's owner: the gradient its value got in ``context_id``."""
    import refimpl.distributed_autograd as dist_autograd

    return dist_autograd.get_gradients(context_id).get(rref.local_value())


def leaf_list(n: int):
    """A value that cannot be held weakly (to_here's key path does not apply to it)."""
    return [torch.full((n,), 2.0, requires_grad=True)]


def leaf_ones(n: int):
    return torch.ones(n, requires_grad=True)


_ONE = torch.ones(3, requires_grad=True)


def rrefs_to_one_tensor(n: int):
    """On the owner: ``n`` RRefs to one tensor (a parameter server's RRefs to its weight)."""
    from torch.distributed import rpc

    return [rpc.RRef(_ONE) for _ in range(n)]


def keys_held() -> int:
    """How many values this worker keeps for fetches by key (rpc.py [Note: fetch by key])."""
    from refimpl.distributed_autograd import rpc as rpc_mod

    return len(rpc_mod._owned)
