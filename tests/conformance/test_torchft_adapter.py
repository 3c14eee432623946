"""torchft's DDP through the adapter in a real 2-rank world: every listener stays on loopback.

[Note: torchft on loopback] (conformance/adapters/engines/torchft.py): the Manager's server, the
lighthouse, the replica's TCPStore and gloo would otherwise listen on every interface. Each rank
lists the TCP listeners its own process holds after one training step and again after
`Wrapped.close()`.
"""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("torchft")


def _rank(rank: int, world: int, store_path: str, queue) -> None:
    import torch.distributed as dist

    from conformance.adapters.engines.torchft import torchft_ddp
    from conformance.adapters.protocol import OptimizerSpec
    from conformance.harness.network import join_local_group, listeners_of
    from conformance.spec import WrapOptions

    join_local_group(store_path, rank, world, timeout=torch.distributed.default_pg_timeout)
    torch.manual_seed(rank)  # rank-dependent: the heal at quorum 0 must make them equal
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    ctx = SimpleNamespace(rank=rank, world_size=world, group=dist.group.WORLD, device=torch.device("cpu"))
    wrapped = torchft_ddp().wrap(model, ctx, WrapOptions(), optimizer=OptimizerSpec("sgd"))
    params = [p.detach().clone() for p in model.parameters()]
    wrapped(torch.full((2, 4), float(rank + 1))).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    wrapped.optimizer.step()
    during = [(str(s), s.loopback) for s in listeners_of([os.getpid()])]
    wrapped.close()
    after = [(str(s), s.loopback) for s in listeners_of([os.getpid()])]
    queue.put((rank, during, after, [t.tolist() for t in params], [g.tolist() for g in grads]))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, 2, os.path.join(tmp, "store"), queue)) for r in range(2)]
        for p in procs:
            p.start()
        out = {r: rest for r, *rest in (queue.get(timeout=180) for _ in procs)}
        for p in procs:
            p.join(timeout=60)
    return out


def test_every_listener_of_a_torchft_run_is_loopback(ranks):
    for rank, (during, after, _, _) in ranks.items():
        assert during, f"rank {rank}: no listener seen (the check would prove nothing)"
        off = [addr for addr, loop in during + after if not loop]
        assert not off, f"rank {rank} listens off loopback: {off}"
    # rank 0 runs the lighthouse too: one more listener than rank 1 (manager, store, gloo)
    assert len(ranks[0][0]) > len(ranks[1][0])


def test_close_stops_the_manager_and_the_lighthouse(ranks):
    for rank, (during, after, _, _) in ranks.items():
        assert len(after) < len(during), f"rank {rank}: close() left {after}"


def test_quorum_zero_heals_every_replica_from_the_primary(ranks):
    assert ranks[0][2] == ranks[1][2], "parameters differ after the step-0 heal"
    assert ranks[0][3] == ranks[1][3], "the all-reduced gradients differ across replicas"
