"""The bucketer area: catalogue shape and plans, refimpl and FairScale on warm pools, and
the zoo's known-bad bucketers (one per clause of docs/contracts/bucketer.md) each caught with
a message that says what is wrong, where its bug fired; the correct base passes the same path."""


import pytest

from conformance import catalogue
from conformance.adapters.bucketer import FairScaleBucketer
from conformance.catalogue.bucketer import chunk, must_be_immediate, plan, shard_elements
from conformance.judge.compare import ConformanceError
from conformance.mutants import bucketer as zoo
from conformance.oracle import bucketer as bucketer_oracle
from conformance.pipeline import check
from conformance.runners import bucketer as driver
from tests.conformance.area_cases import assert_caught, mutant_spec
from tests.conformance.area_cases import scenario as _get

MIXED = "bucketer/mixed/0.0005mb/w2/fp32-fp64-i64-fp16"
OVERSIZED = "bucketer/oversized/0.01mb/w2/fp32"


def test_catalogue_covers_the_issue():
    standard = catalogue.select(area="bucketer", profile="standard")
    assert {s.world_size for s in standard} == {1, 2, 3, 4}
    caps = {s.options.bucket_cap_mb for s in standard}
    assert None in caps and 0 in caps and any(c and c < 0.001 for c in caps)
    dtypes = {d for s in standard for d in s.kwargs()["dtypes"]}
    assert {"float32", "float64", "int64", "float16"} <= dtypes
    assert any(s.model == "many-small" and len(plan(s)) >= 200 for s in standard)
    # an input larger than a shard in the oversized scenarios, none in the default-cap ones
    over = _get(OVERSIZED)
    assert any(must_be_immediate(over, c) for c in plan(over)) and not all(must_be_immediate(over, c) for c in plan(over))
    assert not any(must_be_immediate(s, c) for s in standard if s.options.bucket_cap_mb is None for c in plan(s))
    quick = catalogue.select(area="bucketer", profile="quick")
    # issue 30: quick catches every mutant whose bug shows at <= 2 ranks (own and independent zoo);
    # issue 38 adds its core rows (keyword calls x empty inputs), within the budget
    assert 1 <= sum("/core/" not in s.id for s in quick) <= 10 and sum("/core/" in s.id for s in quick) <= 2


def test_plans_and_data_are_deterministic_integers():
    s = _get(MIXED)
    assert plan(s) == plan(s)
    a = chunk(s, round_=0, rank=1, index=2, dest=0, call=plan(s)[2])
    assert a.equal(chunk(s, round_=0, rank=1, index=2, dest=0, call=plan(s)[2]))
    assert a.abs().max() <= 8 and a.dtype == getattr(__import__("torch"), plan(s)[2].dtype)
    assert not a.equal(chunk(s, round_=0, rank=0, index=2, dest=0, call=plan(s)[2]))
    assert shard_elements(0.01, "float32", 2) == 1310 and shard_elements(0, "float32", 2) == 0


def test_fairscale_unavailable_gives_the_reason(monkeypatch):
    from conformance.adapters import bucketer as mod

    mod._import_fairscale.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "fairscale", None)
    try:
        reason = FairScaleBucketer().unavailable(_get(MIXED))
        assert reason and "fairscale cannot be imported" in reason and "pip install" in reason
    finally:
        mod._import_fairscale.cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["refimpl-bucketer", "fairscale-bucketer"])
@pytest.mark.parametrize("scenario_id", [MIXED, OVERSIZED, "bucketer/disabled/off/w2/fp32-fp64-i64-fp16"])
def test_implementations_conform(session, adapter, scenario_id):
    from conformance.adapters import registry

    reason = getattr(registry.load(adapter), "unavailable", lambda s: None)(_get(scenario_id))
    if reason:
        pytest.skip(reason)
    assert check(_get(scenario_id), adapter, session).comparisons > 10


FORMS = "bucketer/forms/0.005mb/w2/fp32"
GROUPS = "bucketer/groups/0.0005mb/w2/fp32"
# mutant -> (a scenario whose clause it breaks, what the failure says)
CAUGHT = {
    "calls-twice": (MIXED, "ran a second time"),
    "loses-last": (MIXED, "never ran by the end of flush()"),
    "wrong-chunk": (MIXED, "is not the sum over ranks of chunk"),
    "not-reduced": (MIXED, "is not the sum over ranks of chunk"),
    "reversed-order": ("bucketer/mixed/default/w2/fp32-fp64-i64-fp16", "out of submission order"),
    "reuses-output": (MIXED, "changed after a later flush"),
    "defers-oversized": (OVERSIZED, "must be reduced before its call returns"),
    "keeps-input-reference": ("bucketer/reuse/0.0005mb/w2/fp32-fp64-i64-fp16", "is not the sum over ranks of chunk"),
    "ignores-group": (GROUPS, "the implementation raised"),
    "keyword-callback-ignored": (FORMS, "never ran by the end of flush()"),
    "ignores-strides": (FORMS, "is not the sum over ranks of chunk"),
    "skips-empty": ("bucketer/zero-size/0.0005mb/w2/fp32", "never ran by the end of flush()"),
    "stale-rounds": (MIXED, "is not the sum over ranks of chunk"),
    "one-dtype": (MIXED, "dtype torch.float32 but expected"),
}


def test_every_clause_has_a_mutant_and_a_scenario():
    assert set(CAUGHT) == set(zoo.MUTANTS) and len(zoo.MUTANTS) >= 8
    clauses = {c for s in catalogue.select(area="bucketer", profile="standard") for c in s.clauses}
    assert {cls.clause for cls in zoo.MUTANTS.values()} == clauses == {f"B{i}" for i in range(1, 13)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_broken_bucketers_are_caught_where_they_fire(session, name):
    scenario_id, needle = CAUGHT[name]
    caught = assert_caught(lambda s, spec: check(s, spec, session), scenario_id, mutant_spec("bucketer", name), needle)
    assert "rank " in str(caught) and "repro: gradparity run" in str(caught)


@pytest.mark.slow
@pytest.mark.parametrize("scenario_id", [MIXED, FORMS, GROUPS])
def test_the_zoo_base_passes_through_the_same_path(session, scenario_id):
    assert check(_get(scenario_id), "conformance.mutants.bucketer:correct", session).comparisons > 10


@pytest.mark.slow
def test_immediate_rule_is_checked(session):
    """A bucketer that defers even oversized inputs to flush() breaks the documented order."""
    spec = "conformance.mutants.bucketer:reversed_order"  # defers everything
    with pytest.raises(ConformanceError, match="must be reduced before its call returns"):
        check(_get(OVERSIZED), spec, session)


# -- meta: the judge on hand-built records (no processes) -------------------------------------------
def _records(scenario):
    """Records of a correct bucketer that reduces every input at once (allowed for any input)."""
    calls = plan(scenario)
    records = {}
    for rank in range(scenario.world_size):
        rounds = []
        for round_ in range(scenario.steps):
            log, after = [], {}
            for i, call in enumerate(calls):
                log.append(("enter", i))
                if call.callback:
                    value = bucketer_oracle.expected_result(scenario, round_, rank, i, call)
                    log.append(("callback", i, value))
                    after[i] = [value.clone()]
                log.append(("return", i))
            log += [("flush",), ("flushed",)]
            rounds.append({"log": log, "after_flush": after})
        records[rank] = {"rounds": rounds, "error": None}
    return records


def _first_callback(records, rank=1):
    log = records[rank]["rounds"][0]["log"]
    return log, next(p for p, e in enumerate(log) if e[0] == "callback")


def test_judge_passes_the_correct_records():
    assert driver.judge(_get(MIXED), "meta", _records(_get(MIXED))).comparisons > 10


@pytest.mark.parametrize("change, needle", [
    ("one-element", "is not the sum over ranks of chunk"),
    ("one-callback-missing", "never ran by the end of flush()"),
    ("one-callback-twice", "ran a second time"),
    ("one-result-changed-later", "changed after a later flush"),
])
def test_judge_fails_on_one_element_or_one_callback(change, needle):
    records = _records(_get(MIXED))
    log, pos = _first_callback(records)
    i = log[pos][1]
    if change == "one-element":
        value = log[pos][2].clone()
        value.view(-1)[0] += 1
        log[pos] = ("callback", i, value)
    elif change == "one-callback-missing":
        del log[pos]
    elif change == "one-callback-twice":
        log.insert(pos + 1, log[pos])
    else:
        records[1]["rounds"][0]["after_flush"][i][0].view(-1)[0] += 1
    with pytest.raises(ConformanceError, match=needle) as info:
        driver.judge(_get(MIXED), "meta", records)
    assert "rank 1" in str(info.value)
