"""ReduceScatterBucketer against the exact sum over ranks (integer data, so sums are exact).

Each test function spawns one gloo world and runs many checks in it (spawning costs ~3 s).
Every rank recomputes every rank's inputs from seeds, so it knows the exact expected result.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from refimpl.sharded.bucketer import ReduceScatterBucketer, StagingState
from tests.refimpl._refimpl_world import run_world

WORLD_TIMEOUT_S = 60


# --- rank-side checks -------------------------------------------------------------------------
def _chunks(seed: int, rank: int, world_size: int, shape, dtype):
    """The world_size chunks rank ``rank`` submits for input ``seed`` (small integers)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [torch.randint(-8, 9, shape, generator=g).to(dtype) for _ in range(world_size)]


def _expected(seed, rank, world_size, shape, dtype):
    """Exact sum over submitting ranks of their chunk ``rank`` (computed in float64)."""
    total = sum(_chunks(seed, r, world_size, shape, torch.float64)[rank] for r in range(world_size))
    return total.to(dtype)


CASES = [  # (shape, dtype): mixed sizes, dtypes, a 0-dim and an empty tensor
    ((7,), torch.float32), ((3, 5), torch.float32), ((), torch.float32), ((50,), torch.float64),
    ((33,), torch.int64), ((9,), torch.int32), ((40,), torch.float16), ((12,), torch.bfloat16),
    ((0,), torch.float32), ((130,), torch.float32), ((2, 60), torch.float32),
    ((400,), torch.float32),  # larger than a float32 shard for every world size here
    ((64,), torch.float16), ((1,), torch.int64),
]


def _submit(bucketer, group, rank, world_size, cases, seed0, results, calls):
    for i, (shape, dtype) in enumerate(cases):
        seed = seed0 + i

        def callback(out, seed=seed):
            calls[seed] = calls.get(seed, 0) + 1
            results[seed] = out.clone()

        bucketer.reduce_scatter_async(_chunks(seed, rank, world_size, shape, dtype), group,
                                      callback)


def _check_results(rank, world_size, cases, seed0, results, calls, label):
    for i, (shape, dtype) in enumerate(cases):
        seed = seed0 + i
        assert calls.get(seed) == 1, (
            f"[{label}] callback of input {i} {shape}/{dtype} called {calls.get(seed, 0)} times, "
            f"expected exactly once after flush()")
        want = _expected(seed, rank, world_size, shape, dtype)
        got = results[seed]
        assert got.dtype == dtype and got.shape == want.shape, (
            f"[{label}] input {i}: got {tuple(got.shape)}/{got.dtype}, want {tuple(want.shape)}/{dtype}")
        assert torch.equal(got, want), (
            f"[{label}] rank {rank} input {i} {shape}/{dtype}: got {got.flatten()[:8].tolist()}, "
            f"want {want.flatten()[:8].tolist()}")


def _bucketer_checks_all_sizes(rank, world_size):
    """Run the checks on groups of every size 1..world_size inside one world (one spawn).

    Groups are created by every rank (``new_group`` is collective over the default group);
    only members run the checks. The full-size case uses ``dist.group.WORLD`` itself.
    """
    done = {}
    for size in range(1, world_size + 1):
        members = list(range(size))
        group = dist.group.WORLD if size == world_size else dist.new_group(members)
        twin = dist.new_group(members)  # same ranks, distinct group object
        if rank in members:
            done[size] = _bucketer_checks(dist.get_rank(group), size, group, twin)
    return done


def _bucketer_checks(rank, world_size, group, other):
    """All checks for one group; ``rank``/``world_size`` are the rank's place in ``group``."""
    checks = []
    # 1 KiB buckets: float32 shard of 256 // W elements, so some inputs share a bucket, some
    # force a flush, one (400 elements) is always unbucketed.
    cap_mb = 1 / 1024
    for cap in (cap_mb, 25, 0, -1):
        b = ReduceScatterBucketer(bucket_cap_mb=cap)
        results, calls = {}, {}
        _submit(b, group, rank, world_size, CASES, 100, results, calls)
        b.flush()
        _check_results(rank, world_size, CASES, 100, results, calls, f"cap={cap}")
        nonempty = sum(1 for s, _ in CASES if torch.Size(s).numel() > 0)
        if cap <= 0:
            assert b.num_collectives == nonempty == b.num_unbucketed, (
                f"cap={cap} must disable bucketing: {b.num_collectives} collectives for "
                f"{nonempty} non-empty inputs")
            assert b.memory_bytes() == 0, f"cap={cap} allocated {b.memory_bytes()} bytes"
        else:
            assert b.num_collectives < nonempty, f"cap={cap}: nothing was bucketed"
            assert b.memory_bytes() > 0
        b.teardown()
        assert b.memory_bytes() == 0, f"{b.memory_bytes()} bytes held after teardown()"
        assert all(s is StagingState.UNALLOCATED for s in b.states().values())
        checks.append(f"cap={cap}")

    # Oversized input is reduced at once; its callback runs before earlier queued ones.
    b = ReduceScatterBucketer(bucket_cap_mb=cap_mb)
    order = []
    shard = b.shard_size(torch.float32, world_size)
    small = _chunks(1, rank, world_size, (4,), torch.float32)
    big = _chunks(2, rank, world_size, (shard + 1,), torch.float32)
    b.reduce_scatter_async(small, group, lambda out: order.append("small"))
    b.reduce_scatter_async(big, group, lambda out: order.append("big"))
    b.reduce_scatter_async(small, group, lambda out: order.append("small2"))
    assert order == ["big"], f"before flush only the unbucketed input has run, got {order}"
    b.flush()
    assert order == ["big", "small", "small2"], f"documented order violated: {order}"
    checks.append("order")

    # A full bucket is flushed (callbacks run) before an input that would overflow it.
    b = ReduceScatterBucketer(bucket_cap_mb=cap_mb)
    ran = []
    half = shard // 2 + 1
    b.reduce_scatter_async(_chunks(3, rank, world_size, (half,), torch.float32), group,
                           lambda out: ran.append(1))
    assert ran == [] and b.num_collectives == 0
    b.reduce_scatter_async(_chunks(4, rank, world_size, (half,), torch.float32), group,
                           lambda out: ran.append(2))
    assert ran == [1] and b.num_collectives == 1, "overflowing input must flush the bucket first"
    # teardown with a pending input is refused with an actionable message
    with pytest.raises(AssertionError, match=r"flush\(\)"):
        b.teardown()
    b.flush()
    assert ran == [1, 2]
    b.teardown()
    assert b.memory_bytes() == 0
    # reusable after teardown; setup() re-allocates ahead of time
    b.setup()
    assert b.memory_bytes() > 0
    b.teardown()
    checks.append("overflow+teardown")

    # 200 small tensors, default cap: one collective; results survive later flushes.
    b = ReduceScatterBucketer()
    results, calls = {}, {}
    many = [((5 + i % 7,), torch.float32) for i in range(200)]
    views = {}
    for i, (shape, dtype) in enumerate(many):
        b.reduce_scatter_async(_chunks(500 + i, rank, world_size, shape, dtype), group,
                               lambda out, i=i: views.setdefault(i, out))
    b.flush()
    assert b.num_collectives == 1, f"200 small inputs took {b.num_collectives} collectives"
    b.reduce_scatter_async(_chunks(9, rank, world_size, (300,), torch.float32), group)
    b.flush()
    for i, (shape, dtype) in enumerate(many):
        assert torch.equal(views[i], _expected(500 + i, rank, world_size, shape, dtype)), (
            f"result view {i} was overwritten by a later flush")
    checks.append("200-small")

    # Buckets are per group: a second group object over the same ranks gets its own bucket.
    b = ReduceScatterBucketer()
    results, calls = {}, {}
    _submit(b, group, rank, world_size, CASES[:3], 700, results, calls)
    _submit(b, other, rank, world_size, CASES[:3], 800, results, calls)
    assert len(b.states()) == 2, f"expected one bucket per group, got {len(b.states())}"
    b.flush()
    _check_results(rank, world_size, CASES[:3], 700, results, calls, "group WORLD")
    _check_results(rank, world_size, CASES[:3], 800, results, calls, "second group")
    checks.append("groups")

    # Misuse gives actionable errors.
    with pytest.raises(AssertionError, match="one chunk per rank"):
        b.reduce_scatter_async([torch.zeros(3)] * (world_size + 1), group)
    with pytest.raises(TypeError, match="explicit process group"):
        b.reduce_scatter_async([torch.zeros(3)] * world_size, None)
    checks.append("errors")
    return checks


@pytest.mark.slow
def test_bucketed_reduce_scatter_equals_exact_sum(tmp_path):
    """Groups of size 1, 2 and 3 inside one 3-rank world (spawning a world per size costs ~3 s
    each, more on a 2-core machine)."""
    results = run_world(_bucketer_checks_all_sizes, 3, timeout=WORLD_TIMEOUT_S)
    assert sorted(results[0]) == [1, 2, 3], results[0]
    assert sorted(results[1]) == [2, 3] and sorted(results[2]) == [3], results
    for per_rank in results:
        for size, checks in per_rank.items():
            assert len(checks) == 9, f"group size {size}: only {checks} ran"


# --- no process group needed ------------------------------------------------------------------
def test_shard_size_splits_cap_by_world_size():
    b = ReduceScatterBucketer(bucket_cap_mb=1)
    assert b.shard_size(torch.float32, 1) == 262144
    assert b.shard_size(torch.float32, 2) == 131072
    assert b.shard_size(torch.float16, 4) == 131072
    assert b.shard_size(torch.float32, 3) == 87381
    assert ReduceScatterBucketer(0).shard_size(torch.float32, 2) == 0
    assert ReduceScatterBucketer(-5).shard_size(torch.float32, 2) == 0


def test_docstring_documents_callback_order():
    doc = ReduceScatterBucketer.__doc__
    assert "Usage::" in doc and "big" in doc and "small2" in doc
