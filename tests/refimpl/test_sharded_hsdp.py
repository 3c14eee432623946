"""refimpl ZeRO-3 with HSDP (refimpl/sharded/hsdp.py): shard within a group, replicate across groups.

One 4-rank gloo world as a (2 replicas, 2 shards) mesh. A linear model on small-integer data
has integer gradients, so every sum is exact in fp32 and the HSDP engine must be *bitwise* the
same engine sharded over all four ranks: after construction (rank 0's state everywhere, though
each rank builds its model from its own seed), after every backward and every step, with local
accumulation (``no_sync()``) and with reduce-scatter-only accumulation
(``set_requires_all_reduce(False)``), where a micro-batch's reduced chunk is kept as a partial
and the rank's sharded gradient stays untouched until the synced backward all-reduces it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from refimpl.sharded.zero3 import FullyShardedDataParallel
from tests.refimpl._refimpl_world import run_world


def _net(seed):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3, bias=False), nn.Linear(3, 2))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randint(-2, 3, p.shape).float())
    return net


def _x(step, micro, rank):
    return torch.randint(-3, 4, (4, 5), generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank)).float()


def _train(model, rank, mode):
    opt = model.make_optimizer(torch.optim.SGD, lr=2.0**-6)
    out = [model.full_parameters()]
    for step in range(2):
        if mode != "synced":
            ctx = model.no_all_reduce() if mode == "rs-only" else model.no_sync()
            with ctx:
                model(_x(step, 0, rank)).sum().backward()
            if mode == "rs-only":  # reduce-scattered and kept: nothing in p.grad nor in the shard's grad
                out.append(("held", len(model._replicas.partials), [q.shard.grad is None for q in model._params],
                            [q.param.grad is None for q in model._params]))
        model(_x(step, 1, rank)).sum().backward()
        out.append(model.full_gradients())
        opt.step()
        opt.zero_grad()
        out.append(model.full_parameters())
    return out


def _hsdp_vs_world(rank, world_size):
    shard = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    results = {}
    for mode in ("synced", "local", "rs-only"):
        world = FullyShardedDataParallel(_net(rank), units=[], reshard_after_forward=True)
        net = _net(rank)  # another object, the same seeds: rank 0's state must reach all four ranks
        hsdp = FullyShardedDataParallel(net, process_group=shard[rank // 2], replicate_group=replicate[rank % 2],
                                        units=[net[0], net[2]])
        results[mode] = (_train(world, rank, mode if mode != "rs-only" else "local"), _train(hsdp, rank, mode))
    return results


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(
            (a[k] is None and b[k] is None) or (a[k] is not None and b[k] is not None and torch.equal(a[k], b[k]))
            for k in a)
    return a == b


def test_hsdp_is_bitwise_the_engine_over_the_whole_world():
    for rank, results in enumerate(run_world(_hsdp_vs_world, 4, timeout=300)):
        for mode, (world, hsdp) in results.items():
            hsdp = [e for e in hsdp if not (isinstance(e, tuple) and e[0] == "held")]
            assert len(world) == len(hsdp)
            for i, (a, b) in enumerate(zip(world, hsdp, strict=True)):
                assert _same(a, b), f"rank {rank}, {mode}: entry {i} differs"
        held = [e for e in results["rs-only"][1] if isinstance(e, tuple)]
        assert held == [("held", 5, [True] * 5, [True] * 5)] * 2, held
