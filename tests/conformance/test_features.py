"""The production-training features: their vocabulary, the oracle's join model, ERROR expectations."""

from __future__ import annotations

import pytest
import torch

from conformance import catalogue
from conformance.features import Features
from conformance.judge import contract
from conformance.judge.compare import ConformanceError
from conformance.oracle import baseline
from conformance.spec import Expect, Scenario


def _scenario(sid: str) -> Scenario:
    return next(s for s in catalogue.all_scenarios() if s.id == sid)


def test_unknown_feature_is_refused():
    s = _scenario("ddp/join-uneven/mlp/w2/fp32").with_(features=(("jion", (1, 2)),))
    with pytest.raises(ValueError, match="unknown features"):
        Features.of(s)


def test_every_family_has_scenarios_at_two_to_four_ranks_with_five_steps():
    families = {}
    for s in catalogue.all_scenarios():
        if s.features and "/pairs/" not in s.id:  # the hand-written families (generated rows: tests/conformance/space)
            families.setdefault(s.id.split("/")[1].split("-")[0], set()).add(s.world_size)
            assert Features.of(s).total_steps(s) >= 5 or Features.of(s).throw_on_early_termination, s.id
    for family in ("join", "autocast", "ckpt", "compile", "clip", "requires", "checkpoint", "determinism"):
        assert families[family] - {1}, family
    assert {w for ws in families.values() for w in ws} == {2, 3, 4}


def test_join_oracle_averages_over_active_ranks_with_the_declared_divisor():
    by_initial = baseline.compute(_scenario("ddp/join-uneven/mlp/w2/fp32"))  # batches (5, 3)
    active = baseline.compute(_scenario("ddp/join-active-divisor/mlp/w2/fp32"))  # batches (5, 2)
    steps = [e for e in by_initial.events if e.kind == "backward"]
    assert [e.per_rank[1] is None for e in steps] == [False, False, False, True, True]
    assert by_initial.events[-1].kind == "joined" and all(p is not None for p in by_initial.events[-1].per_rank)
    # Step 0 is the same on both (both ranks active, divisor 2); at step 2 only rank 0 of the
    # active-divisor scenario trains, and its average is its own full gradient (divisor 1).
    first = {n: g for n, g in active.events[0].per_rank[0].items()}
    lone = next(e for e in active.events if e.kind == "backward" and e.step == 2).per_rank[0]
    assert all(torch.equal(a, b) for a, b in zip(first.values(), by_initial.events[0].per_rank[0].values(), strict=True))
    assert any(v.abs().sum() > 0 for v in lone.values())


def test_micro_batches_of_a_feature_scenario_are_accumulated_under_no_sync():
    # Issue 30: the feature loop drove one micro-batch per step whatever the scenario said, so
    # ddp/autocast-no-sync tested no no_sync() at all. Now each micro-batch but the last is a
    # local event (each rank's own gradient), and the synced one averages the local sums.
    s = _scenario("ddp/autocast-no-sync/mlp/w2/fp32")
    events = [e for e in baseline.compute(s).events if e.kind == "backward" and e.step == 0]
    assert [(e.micro, e.synced) for e in events] == [(0, False), (1, True)]
    inside, synced = events[0].per_rank, events[1].per_rank
    assert not all(torch.equal(inside[0][n], inside[1][n]) for n in inside[0])  # each rank's own
    one = baseline.compute(s.with_(micro_batches=1)).events[0].per_rank[0]
    assert not any(torch.equal(one[n], synced[0][n]) for n in one)  # the second micro-batch counts


def test_an_error_expectation_fails_when_no_rank_raises():
    s = _scenario("ddp/join-throw/mlp/w2/fp32")
    assert s.expect == Expect.ERROR
    b = baseline.compute(s)  # batches (5, 3): three steps together, then every rank must raise
    assert [e.kind for e in b.events] == ["backward", "step"] * 3
    records = {r: {"init": {"parameters": b.init_params, "buffers": b.init_buffers}, "error": None,
                   "events": [{"kind": e.kind, "step": e.step, "values": e.per_rank[r], "buffers": e.buffers[r] if e.buffers else None}
                              for e in b.events]} for r in range(2)}
    with pytest.raises(ConformanceError, match="did not raise"):
        contract.check_records(s, "test", b, records)
    for r in records:
        records[r]["error"] = {"type": "RuntimeError", "message": "Rank 1 exhausted all inputs.", "step": 3, "micro": 0}
    assert contract.check_records(s, "test", b, records).accepted_error
