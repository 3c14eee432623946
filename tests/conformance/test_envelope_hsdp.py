"""conformance.oracle.envelope.staged_reduce: HSDP's reduce-scatter-only accumulation tree (issue #26, S21)."""

import torch

from conformance.oracle.envelope import Envelope, reduce, staged_reduce
from conformance.spec import derived_bound, summation_order


def _data(R, S, M, n=2048, seed=0):
    torch.manual_seed(seed)
    return [[torch.randn(n) for _ in range(M)] for _ in range(R * S)]


def _fsdp2(g, R, S, M, order=None):
    """FSDP2's computation: AVG reduce-scatter per micro-batch in each shard group, the chunks
    added in micro-batch order, AVG all-reduce across replicas (in `order`)."""
    reps = []
    for r in range(R):
        acc = None
        for m in range(M):
            b = sum(g[r * S + s][m] for s in range(1, S)) + g[r * S][m] if S > 1 else g[r * S][m]
            b = b / S
            acc = b if acc is None else acc + b
        reps.append(acc)
    total = None
    for r in order or range(R):
        total = reps[r] if total is None else total + reps[r]
    return total / R


def test_2x2_is_one_value_and_local_accumulation_trees_do_not_contain_it():
    R, S, M = 2, 2, 2
    g = _data(R, S, M, n=4096)
    tol = summation_order("float32", 4, divide=("pre", "post", "split"))
    value = _fsdp2(g, R, S, M)
    got = staged_reduce(g, R, tol)
    assert isinstance(got, torch.Tensor) and torch.equal(got, value)  # every tree of 2 terms is one value
    # The 15 trees over the 4 ranks' local sums (no_sync() proper) reject a quarter of its elements:
    plain = reduce([g[r][0] + g[r][1] for r in range(4)], 4, tol)
    assert isinstance(plain, Envelope) and int((~plain.accepts(value)).sum()) > 500
    # an engine that all-reduces only the last micro-batch, or never across replicas
    last_only = sum(g[r][1] for r in range(4)) / 4
    own_replica = sum(g[r][m] for r in range(2) for m in range(M)) / 4
    assert int((got == last_only).sum()) == 0 and int((got == own_replica).sum()) == 0


def test_non_power_of_two_replicas_enumerate_each_placement_and_catch_one_ulp():
    R, S, M = 3, 2, 2
    g = _data(R, S, M)
    env = staged_reduce(g, R, summation_order("float32", 6, divide=("pre", "post", "split")))
    assert isinstance(env, Envelope) and env.rule == "summation-order"
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        assert bool(env.accepts(_fsdp2(g, R, S, M, order)).all())
    pre = sum(sum(g[r * S][m] / 6 + g[r * S + 1][m] / 6 for m in range(M)) for r in range(R))
    assert bool(env.accepts(pre).all())
    off = _fsdp2(g, R, S, M)
    off = torch.nextafter(off, torch.full_like(off, float("inf")))
    assert int((~env.accepts(off)).sum()) > 500  # one ulp off FSDP2's value: rejected where the trees agree
    assert int(env.accepts(_fsdp2(g, R, S, M) * 1.001).sum()) < 50


def test_beyond_enumeration_the_tree_bound_holds_and_is_stated():
    R, S, M = 2, 4, 2
    g = _data(R, S, M)
    env = staged_reduce(g, R, summation_order("float32", 8, divide=("pre", "post", "split")))
    assert isinstance(env, Envelope) and env.radius is not None and "3+1+1 additions" in env.formula
    assert bool(env.accepts(_fsdp2(g, R, S, M)).all())
    assert not bool(env.accepts(_fsdp2(g, R, S, M) * 1.001).all())
    low = staged_reduce([[t.bfloat16() for t in row] for row in g], R, derived_bound("bfloat16", 8))
    assert low.rule == "derived-bound"


def test_unused_entries_add_nothing_and_all_unused_is_none():
    R, S, M = 2, 2, 2
    g = _data(R, S, M, n=8)
    g[1][0] = None  # rank 1 did not use it in micro-batch 0: its shard group sums rank 0's share alone
    got = staged_reduce(g, R, summation_order("float32", 4, divide=("pre",)))
    want = (g[0][0] / 4 + (g[0][1] / 4 + g[1][1] / 4)) + ((g[2][0] / 4 + g[3][0] / 4) + (g[2][1] / 4 + g[3][1] / 4))
    assert torch.equal(got, want)
    assert staged_reduce([[None, None]] * 4, 2, summation_order("float32", 4)) is None
