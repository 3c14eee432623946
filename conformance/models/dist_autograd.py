"""Compositions of the `dist_autograd` area and the functions they run on other workers.

A composition is `comp(mode, leaves) -> list of roots`. `mode` is either "local" (the oracle:
every call is a plain Python call in one process, plain autograd) or an adapter spec (each call
is that adapter's RPC). Functions that run on another worker and call further take `mode`
first, so the nested hop uses the same implementation. Workers may own *parameters*
(`param(mode, seed, name)`): one tensor per (mode, seed, name) per process, created on first use
from the name, so the worker that runs the function owning it holds it, exactly like a
parameter server; the oracle keeps its own copies. Everything here is module-level so RPC can
pickle it by reference.
"""

from __future__ import annotations

import threading
import zlib

import torch

_PARAMS: dict[tuple[str, int, str], torch.Tensor] = {}
_PARAMS_LOCK = threading.Lock()
SHAPE = (4, 4)
DTYPE = torch.float64


def owner(param_name: str) -> int:
    """The worker that owns a parameter: the digit its name ends with (`w1` lives on worker 1)."""
    return int(param_name[-1])


# [Note: an adapter by its mode]
# A composition names its implementation by `mode`, a string, so that it travels in every nested
# RPC: "local" runs each call as a plain Python call (the oracle), any other mode is an adapter
# spec. The models sit below the adapters and do not import their registry; the rank task
# (`conformance.runners.dist_autograd`) hands its loader over when it is imported
# (`use_loader`), and a worker is imported that module before its RPC agent starts (the agent
# is started by that module's `run`), so every call that reaches a worker finds the loader.
# A worker started by other means (a test's RPC world) has no rank task: there the registry's
# loader is named by string, as the area entries name their pieces (conformance/areas/), and
# resolved on first use.
_LOADER: list = []  # [load(spec) -> adapter], set once per process
_REGISTRY_LOADER = "conformance.adapters.registry:load"


def use_loader(load) -> None:
    """How `adapter_for` turns a mode into an adapter in this process (the registry's `load`)."""
    _LOADER[:] = [load]


def adapter_for(mode: str):
    if not _LOADER:
        import importlib

        module, _, name = _REGISTRY_LOADER.partition(":")
        use_loader(getattr(importlib.import_module(module), name))
    return _LOADER[0](mode)


def call(mode: str, to: str, fn, args: tuple):
    if mode == "local":
        return fn(*args)
    return adapter_for(mode).rpc_sync(to, fn, args)


def call_async(mode: str, to: str, fn, args: tuple):
    """A future-like object with .wait()."""
    if mode == "local":
        value = fn(*args)
        fut = torch.futures.Future()
        fut.set_result(value)
        return fut
    return adapter_for(mode).rpc_async(to, fn, args)


def _tensor(seed: int, name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.rand(SHAPE, generator=gen, dtype=DTYPE) * 2 - 1).requires_grad_()


def param(mode: str, seed: int, name: str) -> torch.Tensor:
    with _PARAMS_LOCK:
        key = (mode, seed, name)
        if key not in _PARAMS:
            _PARAMS[key] = _tensor(seed, name)
        return _PARAMS[key]


def owned_params(mode: str, seed: int) -> dict[str, torch.Tensor]:
    with _PARAMS_LOCK:
        return {name: t for (m, s, name), t in _PARAMS.items() if m == mode and s == seed}


def reset_params(mode: str) -> None:
    with _PARAMS_LOCK:
        for key in [k for k in _PARAMS if k[0] == mode]:
            del _PARAMS[key]


def leaves(seed: int, names=("x", "w")) -> dict[str, torch.Tensor]:
    """Worker0's leaves; a name starting with "s" is a sparse one (issue 16 block below)."""
    return {n: sparse_leaf(seed, n) if n.startswith("s") else _tensor(seed, n) for n in names}


# -- functions run on other workers ------------------------------------------------------------
def ignore_second(x, y):
    return x * 3


def scale_by_param(mode, seed, h, name):
    """On the worker owning `name`: tanh(h * p)."""
    return torch.tanh(h * param(mode, seed, name))


def hop_to_2(mode, seed, x):
    """On worker1: compute with b1, call worker2 (which uses w2), compute again: chain 0 -> 1 -> 2."""
    h = x * 2 + param(mode, seed, "b1")
    z = call(mode, "worker2", scale_by_param, (mode, seed, h, "w2"))
    return z.sin() + h


def back_to_0(mode, seed, x, w):
    """On worker1: call back into worker0, which uses its own parameter p0: round trip 0 -> 1 -> 0."""
    y = x.exp() * w
    z = call(mode, "worker0", scale_by_param, (mode, seed, y, "p0"))
    return z * y + y


def nested_structures(pair, items, named):
    a, b = pair
    return {"prod": (a * b, [a + items[0]]), "cos": named["t"].cos(), "n": 3}


class SimulateBackwardError(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("Simulate error on backward pass")


def fail_in_backward(x):
    return SimulateBackwardError.apply(x * 2)


def fail_deeper(mode, x):
    """On worker1: forward to worker2, whose backward will fail."""
    return call(mode, "worker2", fail_in_backward, (x + 1,)) * 2


# -- compositions: comp(mode, seed, leaves) -> roots --------------------------------------------
def simple(mode, seed, L):
    return [call(mode, "worker1", torch.mul, (L["x"], L["w"])).sum()]


def chain(mode, seed, L):
    y = call(mode, "worker1", hop_to_2, (mode, seed, L["x"] * L["w"]))
    return [(y * L["w"]).sum()]


def fan_out(mode, seed, L):
    h = L["x"] * L["w"]
    a = call(mode, "worker1", torch.tanh, (h,))
    b = call(mode, "worker2", torch.sigmoid, (h,))
    return [(a * b).sum() + h.sum()]


def sent_twice(mode, seed, L):
    x, w = L["x"], L["w"]
    a = call(mode, "worker1", torch.mul, (x, w))
    b = call(mode, "worker1", torch.add, (x, a))
    c = call(mode, "worker2", torch.mul, (x, x))
    return [(a + b * c).sum()]


def round_trip(mode, seed, L):
    y = call(mode, "worker1", back_to_0, (mode, seed, L["x"], L["w"]))
    return [(y * L["x"]).sum()]


def multi_roots(mode, seed, L):
    x, w = L["x"], L["w"]
    return [
        call(mode, "worker1", torch.add, (x, w)).sum(),
        call(mode, "worker2", torch.mul, (x, w)).sum(),
        call(mode, "worker1", torch.cos, (x,)).sum(),
        (x * w).sum(),
    ]


def unused_arg(mode, seed, L):
    """w is sent but the callee ignores it: w's gradient is absent (not zero)."""
    return [call(mode, "worker1", ignore_second, (L["x"], L["w"])).sum()]


def unused_result(mode, seed, L):
    """A remote result that the loss never uses (a send function that gets no gradient)."""
    call(mode, "worker1", torch.add, (L["x"], L["w"]))
    return [call(mode, "worker1", torch.mul, (L["x"], L["w"])).sum()]


def unused_leaf(mode, seed, L):
    """u requires grad but takes part in nothing: absent from the context."""
    return [call(mode, "worker1", torch.mul, (L["x"], L["w"])).sum()]


def structures(mode, seed, L):
    x, w = L["x"], L["w"]
    out = call(mode, "worker1", nested_structures, ((x, w), [x * 2], {"t": w}))
    assert out["n"] == 3
    prod, (s,) = out["prod"]
    return [(prod * s).sum() + out["cos"].sum()]


def remote_params(mode, seed, L):
    """Parameters on worker1 and worker2 (a parameter server): their grads live in those contexts."""
    h = call(mode, "worker1", scale_by_param, (mode, seed, L["x"], "w1"))
    z = call(mode, "worker2", scale_by_param, (mode, seed, h, "w2"))
    return [(z * L["w"]).sum()]


def async_calls(mode, seed, L):
    """rpc_async to two workers at once, both futures waited on."""
    f1 = call_async(mode, "worker1", torch.matmul, (L["x"], L["w"]))
    f2 = call_async(mode, "worker2", torch.mul, (L["x"], L["x"]))
    return [(f1.wait() * f2.wait()).sum()]


def remote_error(mode, seed, L):
    """The backward fails on worker2 (reached through worker1)."""
    return [call(mode, "worker1", fail_deeper, (mode, L["x"])).sum()]


COMPOSITIONS = {
    "simple": simple, "chain": chain, "fan-out": fan_out, "sent-twice": sent_twice,
    "round-trip": round_trip, "multi-roots": multi_roots, "unused-arg": unused_arg,
    "unused-result": unused_result, "unused-leaf": unused_leaf, "structures": structures,
    "remote-params": remote_params, "async": async_calls, "retain-graph": chain,
    "remote-error": remote_error,
}
LEAVES = {"unused-leaf": ("x", "w", "u")}


# -- issue 16: the failure classes torch's own dist_autograd tests found ------------------------
# Each composition below exercises one of them; conformance/adapters/dist_autograd.py holds a
# known-bad implementation for each (tests/conformance/test_area_dist_autograd.py).
HOOK_CALLS = [0]  # accumulate-hooks: post-hook calls of x's AccumulateGrad on this process


class _LocalRRef:
    """The oracle's stand-in for an RRef: the value, fetched by a plain call."""

    def __init__(self, value):
        self.value = value

    def to_here(self):
        return self.value


def remote(mode: str, to: str, fn, args: tuple):
    if mode == "local":
        return _LocalRRef(fn(*args))
    return adapter_for(mode).remote(to, fn, args)


def sparse_leaf(seed: int, name: str) -> torch.Tensor:
    """A 4x4 sparse COO leaf (about half the entries set) requiring grad."""
    dense = _tensor(seed, name).detach()
    return (dense * (dense > 0)).to_sparse().requires_grad_()


def to_sparse_scaled(x):
    return (x * 3).to_sparse()


@torch.jit.script
def script_mul_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b + a


class SameGradTwice(torch.autograd.Function):
    """Its backward returns one tensor as the gradient of both inputs (like torch's test)."""

    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def _count_hook(grad_inputs, grad_outputs):
    HOOK_CALLS[0] += 1


def rref_to_here(mode, seed, L):
    """torch's own RRef.to_here() on a remote result: the fetch must carry the gradient back."""
    rref = remote(mode, "worker1", torch.mul, (L["x"], L["w"]))
    return [(rref.to_here() * L["x"]).sum()]


def sparse(mode, seed, L):
    """A sparse leaf sent as an argument, a sparse result sent back: sparse tensors and sparse
    gradients cross the RPC both ways."""
    y = call(mode, "worker1", torch.sparse.mm, (L["s"], L["w"]))
    z = call(mode, "worker1", to_sparse_scaled, (L["x"],))
    return [(y * L["x"]).sum() + torch.sparse.sum(z * 2)]


def torchscript(mode, seed, L):
    """A TorchScript function as the RPC target."""
    y = call(mode, "worker1", script_mul_add, (L["x"], L["w"]))
    return [(y * L["w"]).sum()]


def tensor_free(mode, seed, L):
    """worker2 is reached only by an RPC without tensors requiring grad: it still holds the
    context (its answer could have carried one), which must be released with it."""
    n = call(mode, "worker2", torch.ones, ((4, 4),))
    y = call(mode, "worker1", torch.mul, (L["x"], L["w"]))
    return [(y * n).sum()]


def shared_grad(mode, seed, L):
    """One backward function returns one tensor for two leaves: each needs a buffer of its own."""
    h = SameGradTwice.apply(L["x"], L["w"])
    return [call(mode, "worker1", torch.tanh, (h,)).sum()]


def accumulate_hooks(mode, seed, L):
    """A post hook on x's AccumulateGrad node: the distributed backward must run it, once per
    pass, as torch's engine does."""
    h = L["x"] * L["w"]
    h.grad_fn.next_functions[0][0].register_hook(_count_hook)
    return [call(mode, "worker1", torch.tanh, (h,)).sum()]


COMPOSITIONS.update({
    "rref-to-here": rref_to_here, "sparse": sparse, "torchscript": torchscript,
    "tensor-free": tensor_free, "shared-grad": shared_grad, "accumulate-hooks": accumulate_hooks,
})
LEAVES.update({"sparse": ("x", "w", "s")})


# -- issue 30: cells of the dimension checklist (docs/contracts/dist_autograd.md) ----------------
def local_only(mode, seed, L):
    """A context in which nothing crosses an RPC (how often: zero times): its gradients still go
    into the context, never into .grad."""
    return [(L["x"] * L["w"]).sum() + L["x"].sum()]


def rref_twice(mode, seed, L):
    """One remote() result fetched twice with torch's own RRef.to_here(): both fetches carry the
    gradient back (a later fetch may take another path than the first)."""
    rref = remote(mode, "worker1", torch.mul, (L["x"], L["w"]))
    return [(rref.to_here() * L["x"]).sum() + (rref.to_here() * L["w"]).sum()]


def async_single(mode, seed, L):
    """One rpc_async at two workers (A10 where a bug shows with two workers)."""
    f = call_async(mode, "worker1", torch.mul, (L["x"], L["w"]))
    return [(f.wait() * L["x"]).sum()]


def roots_twice(mode, seed, L):
    """The same root twice in one backward: the gradient of their sum (twice the root's)."""
    y = call(mode, "worker1", torch.mul, (L["x"], L["w"])).sum()
    return [y, y]


def async_structures(mode, seed, L):
    """Nested arguments and results through rpc_async (A9's structures, A10's call)."""
    x, w = L["x"], L["w"]
    out = call_async(mode, "worker1", nested_structures, ((x, w), [x * 2], {"t": w})).wait()
    prod, (s,) = out["prod"]
    return [(prod * s).sum() + out["cos"].sum()]


def sparse_twice(mode, seed, L):
    """A sparse leaf sent in two calls: two contributions to one sparse gradient."""
    y1 = call(mode, "worker1", torch.sparse.mm, (L["s"], L["w"]))
    y2 = call(mode, "worker1", torch.sparse.mm, (L["s"], L["w"] * 2))
    return [(y1 * L["x"]).sum() + (y2 * L["x"]).sum()]


def tensor_free_single(mode, seed, L):
    """The only callee is reached by an RPC without tensors requiring grad (A15 at two workers)."""
    n = call(mode, "worker1", torch.ones, (SHAPE,))
    return [(L["x"] * L["w"] * n).sum()]


COMPOSITIONS.update({
    "tensor-free-single": tensor_free_single,
    "local-only": local_only, "rref-twice": rref_twice, "async-single": async_single,
    "retain-graph-simple": simple, "roots-twice": roots_twice, "async-structures": async_structures,
    "sparse-twice": sparse_twice, "accumulate-hooks-retained": accumulate_hooks,
})
LEAVES.update({"sparse-twice": ("x", "w", "s")})


# round 9: the cells round 8 left open (inputs of A5, A11, A12; how often for A14, A15, A16)
def hop_structures(mode, seed, pair, named):
    """On worker1: nested arguments in, nested arguments on to worker2, a nested result back."""
    a, b = pair
    h = a * 2 + param(mode, seed, "b1")
    out = call(mode, "worker2", nested_structures, ((h, b), [a], {"t": named["t"]}))
    prod, (s,) = out["prod"]
    return {"h": [h], "z": (prod * s + out["cos"],)}


def chain_structures(mode, seed, L):
    """A -> B -> C with nested containers at both hops (A11's inputs)."""
    x, w = L["x"], L["w"]
    out = call(mode, "worker1", hop_structures, (mode, seed, (x, w), {"t": w * 3}))
    return [(out["z"][0] * out["h"][0]).sum()]


def fetch_scaled(rref, w):
    """On a worker that does not own `rref`: fetch it (RRef.to_here) and compute with it."""
    return rref.to_here() * w


def rref_arg(mode, seed, L):
    """An RRef passed as an argument to an RPC on a third worker, which fetches it from its
    owner: the gradient flows back through both the fetch and the call (A12's inputs)."""
    rref = remote(mode, "worker1", torch.mul, (L["x"], L["w"]))
    y = call(mode, "worker2", fetch_scaled, (rref, L["w"]))
    return [(y * L["x"]).sum()]


def torchscript_async(mode, seed, L):
    """A TorchScript target through rpc_async and rpc_sync in one context (A14: the target is called twice)."""
    f = call_async(mode, "worker1", script_mul_add, (L["x"], L["w"]))
    y = call(mode, "worker1", script_mul_add, (L["w"], L["x"]))
    return [(f.wait() * y).sum()]


def tensor_free_twice(mode, seed, L):
    """Two tensor-free calls to the only callee (A15: how often): its context is released once."""
    n = call(mode, "worker1", torch.ones, (SHAPE,))
    m = call(mode, "worker1", torch.full, (SHAPE, 2.0))
    return [(L["x"] * L["w"] * n * m).sum()]


COMPOSITIONS.update({
    "chain-structures": chain_structures, "rref-arg": rref_arg, "torchscript-async": torchscript_async,
    "tensor-free-twice": tensor_free_twice, "retain-graph-structures": structures,
    "shared-grad-retained": shared_grad,
})
# passes: all but the last with retain_graph=True
RETAINED = {"retain-graph": 4, "retain-graph-simple": 3, "accumulate-hooks-retained": 3,
            "retain-graph-structures": 3, "shared-grad-retained": 3}


# -- issue 40: contexts opened on two workers meet on a third (A18) ---------------------------------
PEER_SEED = 1000  # worker1's leaves in `contexts-meet` are those of seed + PEER_SEED


def contexts_meet(mode, seed, L):
    """What each of the two callers (worker0, and worker1 in a context of its own) runs: its
    leaves through worker2's parameter w2, so both contexts' graphs meet on worker2
    (conformance/runners/dist_autograd_meet.py)."""
    y = call(mode, "worker2", scale_by_param, (mode, seed, L["x"] * L["w"], "w2"))
    return [(y * L["w"]).sum()]


COMPOSITIONS["contexts-meet"] = contexts_meet


def passes(kind: str) -> int:
    """How many backward passes the runner makes in one context of composition `kind`."""
    return RETAINED.get(kind, 1)
