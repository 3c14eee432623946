"""The generated compositions of the `dist_autograd` area (issue 38): one composition per row.

A hand-written composition (`conformance.models.dist_autograd.COMPOSITIONS`) fixes one shape; a
row of the area's space (`conformance.space.dist_autograd`) says how each part is built, and
`composed` builds it from those values, the same way in mode "local" (the oracle: plain calls in
one process, plain autograd) and through an adapter. The scenario's `model` is `COMPOSED` and its
`model_kwargs` are the row.

Shape: worker 0 computes `h = x * w` and sends it (`hop` runs on each callee: `tanh(h)`, times a
parameter the callee owns with remote parameters, onward to the next worker of a chain or back
to worker 0 in a round trip); the roots sum what comes back (one root, or one per call plus the
local part). The row picks the topology, the world size, where parameters live, plain tensors or
nested containers both ways, rpc_sync / rpc_async (every call of a fan-out in flight before the
first is waited on) / remote() with RRef.to_here(), an unused leaf / an ignored argument / a
result no root uses, the dtype, and a backward that fails on the last worker reached. Retained
passes and a second context are the runner's (`passes_of`, `contexts_of`).
"""

from __future__ import annotations

import functools

import torch

from conformance.models import dist_autograd as fns

COMPOSED = "composed"
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}


def spec_of(scenario) -> dict:
    return scenario.kwargs() if scenario.model == COMPOSED else {}


def composition_of(scenario, kind: str):
    """comp(mode, seed, leaves) -> roots for the scenario (a generated row, or a hand-written kind)."""
    if kind == COMPOSED:
        return functools.partial(composed, spec=dict(scenario.model_kwargs))
    return fns.COMPOSITIONS[kind]


def leaves_of(scenario, kind: str, seed: int) -> dict[str, torch.Tensor]:
    """Worker 0's leaves: x, w (and u, unused or ignored) in the row's dtype."""
    if kind != COMPOSED:
        return fns.leaves(seed, fns.LEAVES.get(kind, ("x", "w")))
    spec = spec_of(scenario)
    names = ("x", "w", "u") if spec["unused"] in ("leaf", "arg") else ("x", "w")
    dtype = DTYPES[spec["dtype"]]
    return {n: t.detach().to(dtype).requires_grad_() for n, t in fns.leaves(seed, names).items()}


def passes_of(scenario, kind: str) -> int:
    return spec_of(scenario).get("passes", 0) or fns.passes(kind)


def contexts_of(scenario) -> int:
    return {"one": 1, "two": 2}[spec_of(scenario).get("contexts", "one")]


def fail_node(scenario) -> int | None:
    """The worker whose backward raises (None: none does)."""
    if scenario.model == "remote-error":
        return 2
    spec = spec_of(scenario)
    if spec.get("error", "none") == "none":
        return None
    return scenario.world_size - 1 if spec["topology"] in ("chain", "fan-out") else 1


def after_failure(scenario) -> tuple:
    """(scenario, kind) the context after a failed pass runs: a generated row's own composition
    without the error (so every value of the row has its gradients judged too), else `simple`."""
    if scenario.model != COMPOSED:
        return scenario, "simple"
    row = tuple((k, "none" if k == "error" else v) for k, v in scenario.model_kwargs)
    return scenario.with_(model_kwargs=row), COMPOSED


def param_as(mode: str, seed: int, k: int, dtype: str) -> torch.Tensor:
    """The parameter worker `k` owns in a generated composition (named to end with its owner)."""
    name = f"c{dtype}w{k}"
    with fns._PARAMS_LOCK:
        key = (mode, seed, name)
        if key not in fns._PARAMS:
            fns._PARAMS[key] = fns._tensor(seed, name).detach().to(DTYPES[dtype]).requires_grad_()
        return fns._PARAMS[key]


# -- plain or nested, both ways ------------------------------------------------------------------
def pack(how: dict, h):
    return ((h, h * 2), [h * 3], {"t": h + 1}) if how["structure"] == "nested" else h


def unpack(how: dict, p):
    return (p[0][0] + p[0][1] + p[1][0] + p[2]["t"]) / 4 if how["structure"] == "nested" else p


def pack_result(how: dict, y):
    return {"y": (y,), "z": [y * 0.5], "n": 3} if how["structure"] == "nested" else y


def unpack_result(how: dict, r):
    if how["structure"] != "nested":
        return r
    assert r["n"] == 3
    return r["y"][0] + r["z"][0]


def start(mode: str, how: dict, to: int, fn, args: tuple):
    """Make the call the row's way; returns what finishes it (the value once waited/fetched)."""
    where = f"worker{to}"
    if how["call"] == "async":
        fut = fns.call_async(mode, where, fn, args)
        return fut.wait
    if how["call"] == "rref":
        rref = fns.remote(mode, where, fn, args)
        return rref.to_here
    value = fns.call(mode, where, fn, args)
    return lambda: value


# -- on the callees ----------------------------------------------------------------------------
def hop(mode: str, seed: int, how: dict, k: int, payload, ignored):
    """On worker k: tanh of what came (times k's parameter), onward per `how["next"]`."""
    h = unpack(how, payload)
    if how["params"] == "remote":
        h = h * param_as(mode, seed, k, how["dtype"])
    y = torch.tanh(h)
    after = how["next"].get(k)
    if after is not None:
        z = unpack_result(how, start(mode, how, after, hop, (mode, seed, how, after, pack(how, y), None))())
        y = z * y + y
    if how["fail"] == k:
        y = fns.SimulateBackwardError.apply(y)
    return pack_result(how, y)


# -- on worker 0 ---------------------------------------------------------------------------------
def _how(spec: dict, world: int) -> dict:
    topology = spec["topology"]
    nxt = {}
    if topology == "chain":
        nxt = {k: k + 1 for k in range(1, world - 1)}
    elif topology == "round-trip":
        nxt = {1: 0}
    fail = None
    if spec["error"] != "none":
        fail = world - 1 if topology in ("chain", "fan-out") else 1
    return {"call": spec["call"], "structure": spec["structure"], "params": spec["params"],
            "dtype": spec["dtype"], "next": nxt, "fail": fail}


def _targets(topology: str, world: int) -> list[int]:
    """The callees worker 0 calls, in order (fan-out: all of them; sent-twice: worker 1 twice)."""
    if topology == "fan-out":
        return list(range(1, world))
    if topology == "sent-twice":
        return [1, *range(1, world)]
    return [1]


def composed(mode: str, seed: int, L: dict, spec: dict) -> list:
    world = spec["world"]
    how = _how(spec, world)
    x, w = L["x"], L["w"]
    h = x * w
    if spec["unused"] == "result":  # a remote result no root uses
        start(mode, how, 1, torch.add, (x, w))()
    ignored = None
    if spec["unused"] == "arg":
        ignored = {"ignored": L["u"]} if how["structure"] == "nested" else L["u"]
    finishes = []
    for i, k in enumerate(_targets(spec["topology"], world)):
        finishes.append(start(mode, how, k, hop, (mode, seed, how, k, pack(how, h), ignored if i == 0 else None)))
    parts = [unpack_result(how, finish()).sum() for finish in finishes]  # every call in flight first
    local = (x * w).sum()
    if spec["roots"] == "several":
        return [*parts, local]
    return [sum(parts) + local]
