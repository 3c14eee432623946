"""The discovered all-reduce order against real gloo all-reduces (conformance.oracle.allreduce_order).

Spawned 3- and 4-rank gloo worlds (loopback) probe lengths from 1 to 20,000 elements (fp32, and
fp16 for two), then all-reduce random data of wide dynamic range: the discovered order must
reproduce every result bitwise, and adding in rank order must not (else the probe proved
nothing). A gloo change that sums differently, or in an order that is not fixed, fails here.
"""

from __future__ import annotations

import io
import socket

import pytest
import torch
import torch.multiprocessing as mp

from conformance.oracle.allreduce_order import Orders, OrderUnknown, discover, probe_values, triples

LENGTHS = (1, 2, 3, 5, 7, 16, 129, 1000, 4097, 20000)
SIZES = [(n, "float32") for n in LENGTHS] + [(7, "float16"), (1000, "float16")]


def _data(n: int, dtype: str, world_size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * world_size + n)
    scale = 10.0 ** torch.randint(-3, 4, (world_size, n), generator=g)
    return list((torch.randn(world_size, n, generator=g) * scale).to(getattr(torch, dtype)))


def _world(rank, world_size, port, queue):
    import torch.distributed as dist

    from conformance.oracle.allreduce_order import probe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    probed = probe(None, world_size, rank, SIZES)
    reduced = {}
    for n, dtype in SIZES:
        t = _data(n, dtype, world_size)[rank].clone()
        dist.all_reduce(t)
        reduced[(n, dtype)] = t
    if rank == 0:
        buf = io.BytesIO()
        torch.save((probed, reduced), buf)
        queue.put(buf.getvalue())
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[3, 4], ids=lambda w: f"w{w}")
def gloo(request):
    world_size = request.param
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_world, args=(r, world_size, port, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    probed, reduced = torch.load(io.BytesIO(queue.get(timeout=180)))
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return world_size, probed, reduced


def test_the_discovered_order_reproduces_gloo_bitwise_and_rank_order_does_not(gloo):
    world_size, probed, reduced = gloo
    differs_from_rank_order = 0
    for (n, dtype), got in reduced.items():
        data = _data(n, dtype, world_size)
        replay = discover(world_size, n, probed[(n, dtype)]).sum(data)
        assert torch.equal(replay, got), (n, dtype, int((replay != got).sum()))
        in_rank_order = data[0].clone()
        for t in data[1:]:
            in_rank_order += t
        differs_from_rank_order += int((in_rank_order != got).sum())
    assert differs_from_rank_order > 0, "rank order reproduced gloo everywhere: the probe was not needed"


def test_more_than_one_order_is_in_use(gloo):
    """gloo's ring starts each segment at another rank: several trees per long tensor."""
    world_size, probed, _ = gloo
    assert len(discover(world_size, 20000, probed[(20000, "float32")]).trees) == world_size


def _fake_probe(world_size: int, n: int, order) -> torch.Tensor:
    """What a backend adding in `order` (a tree, the same for every element) returns to the probes."""
    orders = Orders(world_size, [(order, torch.arange(n))])
    per_rank = [probe_values(r, world_size, n, torch.float32) for r in range(world_size)]
    runs = torch.stack([orders.sum([per_rank[r][k] for r in range(world_size)]) for k in range(len(per_rank[0]))])
    return torch.stack([runs, runs])


@pytest.mark.parametrize("tree", [((0, 1), 2), (0, (1, 2)), ((0, 2), 1)])
def test_discovery_finds_each_tree_of_three(tree):
    found = discover(3, 5, _fake_probe(3, 5, tree))
    assert len(found.trees) == 1
    canon = lambda t: t if isinstance(t, int) else frozenset(map(canon, t))  # noqa: E731
    assert canon(found.trees[0][0]) == canon(tree)


def test_a_balanced_tree_of_four_is_told_from_a_chain():
    balanced = discover(4, 3, _fake_probe(4, 3, ((0, 1), (2, 3)))).trees[0][0]
    chain = discover(4, 3, _fake_probe(4, 3, (((0, 1), 2), 3))).trees[0][0]
    assert balanced != chain
    assert {frozenset(balanced[0]), frozenset(balanced[1])} == {frozenset((0, 1)), frozenset((2, 3))}


def test_an_order_that_changes_between_probes_is_refused():
    a, b = _fake_probe(3, 4, ((0, 1), 2)), _fake_probe(3, 4, ((1, 2), 0))
    with pytest.raises(OrderUnknown, match="different orders on repeated probes"):
        discover(3, 4, torch.stack([a[0], b[0]]))


def test_a_sum_that_is_not_pairwise_is_refused():
    fake = _fake_probe(3, 4, ((0, 1), 2))
    fake[:, 0] = 0.5  # e.g. a compensated or wider sum would not read exactly 0 or 1
    with pytest.raises(OrderUnknown, match="other than 0 or 1"):
        discover(3, 4, fake)
    fake = _fake_probe(3, 4, ((0, 1), 2))
    fake[:, : len(triples(3)) * 3] = 0  # no pair of a triple added first
    with pytest.raises(OrderUnknown, match="no single pair"):
        discover(3, 4, fake)


def test_the_probes_all_reduce_on_the_ranks_device(monkeypatch):
    """NCCL takes only the rank's GPU tensors: the probes are built on the device the caller
    names (the CPU stand-in of refimpl.device_check catches a probe built without one)."""
    import torch.distributed as dist

    from conformance.oracle.allreduce_order import probe
    from refimpl.device_check import expect_collective_device

    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: seen.append(t.device))  # a group of 3 that adds nothing
    with expect_collective_device("cpu", stray="meta"):
        out = probe(None, 3, 0, [(4, "float32")], repeats=1, device="cpu")
    assert seen == [torch.device("cpu")] * 3
    assert out[(4, "float32")].shape == (1, 3, 4) and out[(4, "float32")].device.type == "cpu"
