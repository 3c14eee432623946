"""Engine-level stress for refimpl's distributed autograd (issue 40): many short contexts from
several threads at once, with backward passes running concurrently, some of whose remote calls
answer with no gradient at all (a result that does not depend on the tensor sent), on a machine
whose cores busy processes take. Every context's gradients must be local autograd's, and every
worker must survive. Runs as a check on worker 0 of an ``RpcWorld`` (test_dist_autograd_stress.py).
"""

from __future__ import annotations

import os
import threading

import torch

import refimpl.distributed_autograd as da

ROUNDS_ENV = "REFIMPL_ENGINE_STRESS_ROUNDS"


def _hop(x: torch.Tensor) -> torch.Tensor:
    """On worker 1: on to worker 2, and back."""
    return da.rpc_sync("worker2", torch.tanh, args=(x * 2,)) + x


def _ignores(x: torch.Tensor) -> torch.Tensor:
    """A remote result that does not depend on the tensor sent: its gradient message is empty."""
    return torch.ones(4, dtype=torch.float64)


def _one_context(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(4, generator=gen, dtype=torch.float64).requires_grad_()
    with da.context() as cid:
        y = da.rpc_sync("worker1", _hop, args=(x,))
        z = da.rpc_sync(f"worker{1 + seed % 2}", _ignores, args=(x,))
        da.backward(cid, [(y * z).sum()])
        got = da.get_gradients(cid)[x]
    xl = x.detach().clone().requires_grad_()
    (torch.tanh(xl * 2) + xl).sum().backward()
    assert torch.allclose(got, xl.grad, rtol=1e-12, atol=1e-12), f"context of seed {seed}: {got} != {xl.grad}"


def check(world_size: int) -> None:
    """Worker 0's check: ``REFIMPL_ENGINE_STRESS_ROUNDS`` (default 15) contexts on each of 4 threads."""
    rounds = int(os.environ.get(ROUNDS_ENV, "15"))
    errors: list[str] = []

    def loop(k: int) -> None:
        try:
            for i in range(rounds):
                _one_context(k * 100_000 + i)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"thread {k}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
