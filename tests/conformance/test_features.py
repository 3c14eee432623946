"""The production-training features: their vocabulary, the oracle's join model, ERROR expectations."""

from __future__ import annotations

import pytest
import torch

from conformance import baseline, catalogue, contract
from conformance.compare import ConformanceError
from conformance.features import Features
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
        if s.features:
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
