"""Each independent dist_autograd mutant is genuinely buggy: shown outside the suite in a 3-worker RPC
world, by probes compared with the unmutated engine (itself checked against gradients by hand).

Probes run on worker 0 through the adapter, as the suite's runner drives it; remote functions
that call on (a hop) load the same adapter on their worker by its spec, as the suite's do.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from conformance.mutants.independent import dist_autograd as zoo
from tests.conformance.independent_results import same as _same
from tests.refimpl.distributed_autograd.dist_autograd_world import RpcWorld

pytestmark = pytest.mark.slow

MODULE = "conformance.mutants.independent.dist_autograd"


def _spec(name: str) -> str:
    return f"{MODULE}:{name.replace('-', '_')}"


def _adapter(name: str):
    from conformance.adapters import registry

    return registry.load(_spec(name))


# -- remote functions ------------------------------------------------------------------------------
class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


def _boom(x):
    return _Boom.apply(x)


def _mul(a, b):
    return a * b


def _as_dict(a, b):
    return {"y": a * b}


def _leaves():
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([0.25, 3.0, -1.0], dtype=torch.float64, requires_grad=True)
    return x, w


def _grads(a, cid, x, w) -> dict:
    got = a.get_gradients(cid)
    return {"x": got.get(x), "w": got.get(w)}


def _left(a, world_size: int, quiet_s: float = 3.0) -> dict:
    """Each worker's leftover contexts once clean, or after `quiet_s` (a release is asynchronous)."""
    from torch.distributed import rpc

    from conformance.runners.dist_autograd import fetch_debug_info

    deadline = time.monotonic() + quiet_s
    while True:
        infos = {k: rpc.rpc_sync(f"worker{k}", fetch_debug_info, args=(_spec(a.probe_name),)) for k in range(world_size)}
        left = {k: i for k, i in infos.items() if i.get("num_autograd_contexts") or i.get("num_current_backward_passes")}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# -- probes (on worker 0) --------------------------------------------------------------------------
def _error(a):
    x, _ = _leaves()
    with a.context() as cid:
        y = a.rpc_sync("worker2", _boom, (x,))
        try:
            a.backward(cid, [y.sum()])
            node = None
        except RuntimeError as exc:
            node = re.findall(r"Error on Node (\d+)", str(exc))[-1:]
    return {"node": node, "left": sorted(_left(a, 3))}


def _retain(a):
    x, w = _leaves()
    with a.context() as cid:
        root = a.rpc_sync("worker1", _mul, (x, w)).sum()
        a.backward(cid, [root], retain_graph=True)
        a.backward(cid, [root])
        return _grads(a, cid, x, w)


def _async(a):
    x, w = _leaves()
    with a.context() as cid:
        futs = [a.rpc_async(f"worker{k}", _mul, (x, w)) for k in (1, 2)]
        root = (x * w).sum() + sum(f.wait().sum() for f in futs)
        a.backward(cid, [root])
        return _grads(a, cid, x, w)


def _dict(a):
    x, w = _leaves()
    with a.context() as cid:
        root = a.rpc_sync("worker1", _as_dict, (x, w))["y"].sum() + (x * w).sum()
        a.backward(cid, [root])
        return _grads(a, cid, x, w)


def _local_only(a):
    x, w = _leaves()
    with a.context() as cid:
        a.backward(cid, [(x * w).sum()])
        return {**_grads(a, cid, x, w), "dot_grad": x.grad is not None}


def _rref_twice(a):
    x, w = _leaves()
    with a.context() as cid:
        rref = a.remote("worker1", _mul, (x, w))
        root = rref.to_here().sum() + rref.to_here().sum()
        a.backward(cid, [root])
        return _grads(a, cid, x, w)


PROBES = {"error": _error, "retain": _retain, "async": _async, "dict": _dict, "local-only": _local_only,
          "rref-twice": _rref_twice}


def _probe_all(name: str) -> dict:
    a = zoo.correct() if name == "correct" else _adapter(name)
    a.probe_name = name
    out = {}
    for probe, fn in PROBES.items():
        try:
            out[probe] = fn(a)
        except Exception as exc:  # noqa: BLE001 - a raise is a behaviour to compare
            out[probe] = f"raised {type(exc).__name__}"
    return out


def _check_correct_by_hand(world_size):
    got = _probe_all("correct")
    x, w = _leaves()
    x, w = x.detach(), w.detach()
    assert got["error"] == {"node": ["2"], "left": []}, got["error"]
    assert _same(got["retain"], {"x": 2 * w, "w": 2 * x})
    assert _same(got["async"], {"x": 3 * w, "w": 3 * x})
    assert _same(got["dict"], {"x": 2 * w, "w": 2 * x})
    assert _same(got["local-only"], {"x": w, "w": x, "dot_grad": False})
    assert _same(got["rref-twice"], {"x": 2 * w, "w": 2 * x})


def _check_mutants_differ(world_size):
    good = _probe_all("correct")
    same = [n for n in zoo.MUTANTS if _same(_probe_all(n), good)]
    assert not same, f"not shown wrong: {same}"


@pytest.fixture(scope="module")
def world():
    w = RpcWorld(3)
    yield w
    w.close()


def test_correct_by_hand(world):
    world.run(_check_correct_by_hand, timeout_s=120)


def test_mutants_differ_from_correct(world):
    world.run(_check_mutants_differ, timeout_s=300)
