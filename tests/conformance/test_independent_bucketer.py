"""Each independent bucketer mutant is genuinely buggy: shown outside the suite, in a gloo world
of 3 ranks, by probes whose right answers are computed by hand (sums over ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conformance.mutants.independent import bucketer as zoo
from tests.refimpl._refimpl_world import run_world

pytestmark = pytest.mark.slow

W = 3
SHARD8 = 8 * 4 * W / (1024 * 1024)  # cap (MiB) giving 8-element fp32 shards at W=3


def _chunks(rank, shape, dtype=torch.float32, members=W):
    """Chunk r on this rank: (rank + 1) * (r + 1) + arange, integers (exact in every dtype)."""
    n = int(torch.Size(shape).numel())
    return [((rank + 1) * (r + 1) + torch.arange(n) % 3).to(dtype).view(shape) for r in range(members)]


def _probe(make, rank, pair):
    events = {}

    def record(key):
        return lambda out: events.setdefault(key, []).append((out.dtype, out.clone()))

    def step(name, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a raise is an observation here
            events.setdefault(name, []).append(("raised", type(exc).__name__))

    world = dist.group.WORLD

    def fifo():
        b = make(SHARD8)
        b.reduce_scatter_async(_chunks(rank, (3,)), world, record("fifo-a"))
        b.reduce_scatter_async(_chunks(rank, (2, 2)), world, record("fifo-b"))
        b.flush()

    def overflow():
        b = make(SHARD8)
        for i in range(3):
            b.reduce_scatter_async(_chunks(rank, (5,)), world, record(f"over-{i}"))
        b.flush()

    def idle_first():
        b = make(SHARD8)
        b.reduce_scatter_async(_chunks(rank, (2,), torch.float64), world, record("idle-r1"))
        b.flush()
        b.reduce_scatter_async(_chunks(rank, (2,)), world, record("idle-r2"))
        b.flush()

    def exact():
        order = []
        b = make(SHARD8)
        b.reduce_scatter_async(_chunks(rank, (3,)), world, lambda out: order.append("small"))
        b.reduce_scatter_async(_chunks(rank, (8,)), world, lambda out: order.append("exact"))
        b.flush()
        events["exact-order"] = order

    def subgroup(keyword):
        if rank not in (1, 2):
            return
        b = make(SHARD8)
        chunks = _chunks(rank, (2,), members=2)
        if keyword:
            b.reduce_scatter_async(input_list=chunks, group=pair, callback_fn=record("kw-pair"))
        else:
            b.reduce_scatter_async(chunks, pair, record("pair"))
        b.flush()

    def dtypes():
        b = make(SHARD8)
        b.reduce_scatter_async(_chunks(rank, (2,), torch.int64), world, record("int64"))
        b.flush()

    def teardown_queued():
        b = make(SHARD8)
        b.reduce_scatter_async(_chunks(rank, (2,)), world, record("teardown"))
        b.teardown()

    def immediate():
        b = make(SHARD8)
        seen = []
        b.reduce_scatter_async(_chunks(rank, (12,)), world, lambda out: seen.append(1))
        events["immediate-before-return"] = bool(seen)
        b.flush()

    def only_empty():
        b = make(SHARD8)
        b.reduce_scatter_async(_chunks(rank, (0, 3)), world, record("empty"))
        b.flush()

    for name, fn in [("fifo", fifo), ("overflow", overflow), ("idle", idle_first), ("exact", exact),
                     ("pair", lambda: subgroup(False)), ("kw-pair", lambda: subgroup(True)), ("int64", dtypes),
                     ("teardown", teardown_queued), ("immediate", immediate), ("empty", only_empty)]:
        step(name, fn)
        dist.barrier()
    return events


def _rank_main(rank, world_size, names):
    pair = dist.new_group([1, 2])
    out = {}
    for name in names:
        adapter = zoo.correct() if name == "correct" else zoo.MUTANTS[name]()
        out[name] = _probe(adapter.make, rank, pair)
    return out


def _truth(rank):
    """The right answer of every probe on `rank`, by hand."""
    def total(shape, dtype=torch.float32, members=range(W), r=rank):
        n = int(torch.Size(shape).numel())
        return sum(((q + 1) * (r + 1) + torch.arange(n) % 3) for q in members).to(dtype).view(shape)

    t = {
        "fifo-a": [(torch.float32, total((3,)))], "fifo-b": [(torch.float32, total((2, 2)))],
        **{f"over-{i}": [(torch.float32, total((5,)))] for i in range(3)},
        "idle-r1": [(torch.float64, total((2,), torch.float64))], "idle-r2": [(torch.float32, total((2,)))],
        "exact-order": ["small", "exact"], "int64": [(torch.int64, total((2,), torch.int64))],
        "teardown": [("raised", "RuntimeError")], "immediate-before-return": True,
        "empty": [(torch.float32, torch.empty(0, 3))],
    }
    if rank in (1, 2):
        t["pair"] = t["kw-pair"] = [(torch.float32, total((2,), members=(1, 2), r=rank - 1))]
    return t


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def test_correct_is_right_and_every_mutant_is_wrong():
    names = ["correct", *zoo.MUTANTS]
    results = run_world(_rank_main, W, names, timeout=300)
    for rank in range(W):
        assert _same(results[rank]["correct"], _truth(rank)), (rank, results[rank]["correct"])
    wrong = {name for name in zoo.MUTANTS if any(not _same(results[r][name], _truth(r)) for r in range(W))}
    assert wrong == set(zoo.MUTANTS), f"not shown wrong: {sorted(set(zoo.MUTANTS) - wrong)}"
