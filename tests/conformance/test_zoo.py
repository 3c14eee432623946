"""Meta-test of the suite's power: every mutant of the zoo is caught, the controls pass.

The slow test runs `gradparity zoo` on the quick profile (the cheapest profile that catches
every mutant) once; the fast tests pin the counting rules of `conformance.frontends.zoo.judge` on
hand-built results, without processes.
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from conformance import mutants
from conformance.adapters import registry
from conformance.frontends import zoo
from conformance.mutants.base import BucketedDDP

# The scenarios that must be among each mutant's catchers on the quick profile: the one a
# reader would name for the bug. (Others catch several mutants too; they are not pinned.)
EXPECTED_CATCHER = {
    "no-divide": "ddp/plain/mlp/w2/fp32",
    "last-bucket-unreduced": "ddp/plain/mlp/w2/fp32",
    "no-init-broadcast": "ddp/plain/mlp/w2/fp32",
    "skip-unused": "ddp/unused-on-rank1/branches/w2/fp32",
    "no-sync-drops-accumulated": "ddp/no-sync/mlp/w2/fp32",
    "swapped-buckets": "ddp/bucket-tiny/many-tiny/w2/fp32",
    "fp16-communication": "ddp/plain/mlp/w2/fp32",
    "no-buffer-broadcast": "ddp/buffers/buffered/w2/fp32",
    "tied-first-use": "ddp/tied/tied/w2/fp32",
    "sparse-not-reduced": "ddp/sparse/embedding/w2/fp32",
    "batch-weighted": "ddp/uneven/mlp/w2/fp32",
    "stale-gradient": "ddp/plain/mlp/w2/fp32",
    "captured-grad-tensors": "ddp/set-to-none-alternate/mlp/w2/fp32",
    "zero-grad-keeps-gradients": "ddp/zero-grad-engine/mlp/w2/fp32",
    "sum-after-warmup": "ddp/long/mlp/w2/fp32",
    "reads-before-wait": "ddp/skew-backward/mlp/w2/fp32",
    "join-replays-gradient": "ddp/join-uneven/mlp/w2/fp32",
    "non-finite-zeroed": "ddp/autocast-bf16-scaler/mlp/w2/fp32",
    "finalize-on-first-hook": "ddp/ckpt-reentrant-static/ckpt-mlp/w2/fp32",
    "zero-fills-unused": "ddp/requires-grad-toggle/mlp/w2/fp32",
    "state-dict-without-prefix": "ddp/checkpoint-round-trip/mlp/w2/fp32",
    "nondeterministic-sum": "ddp/determinism/mlp/w4/fp32",
    "arrival-order-buckets": "ddp/compile-buckets/mlp/w2/fp32",
    "step-reads-buckets": "ddp/clip-grad-norm/mlp/w2/fp32",
    "reduced-not-copied-back": "ddp/reduce-bf16/mlp/w2/fp32",
    # mixture-of-experts bugs (conformance/mutants/moe.py): the MoE model at two ranks
    "expert-wrong-group": "ddp/plain/moe/w2/fp32",
    "unused-expert-left-out": "ddp/plain/moe/w2/fp32",
    "aux-loss-scaled-twice": "ddp/plain/moe/w2/fp32",
    "draws-between-forwards": "ddp/dropout/gpt/w2/fp32",
}


def test_registry_is_complete_and_loadable():
    assert set(mutants.MUTANTS) == set(EXPECTED_CATCHER)
    for name, (path, bug) in mutants.MUTANTS.items():
        adapter = registry.load(registry.ddp_class_spec(path))
        assert issubclass(adapter.cls, BucketedDDP) and adapter.cls is not BucketedDDP, name
        assert bug and "\n" not in bug, name
        assert adapter.capabilities == BucketedDDP.gradparity_capabilities
    assert [n for n in mutants.MUTANTS if mutants.may_abort(n)] == ["skip-unused"]


# -- counting rules, on hand-built results --------------------------------------------------------
def _result(adapter, scenario, verdict="passed", *, kind="", fired=0, records=2):
    return {"adapter": adapter, "scenario": scenario, "verdict": verdict, "kind": kind, "fired": fired,
            "records": records, "message": "boom" if verdict == "failed" else ""}


def _judge(mutant: str, *results):
    chosen = mutants.area_zoo("ddp").mutants[mutant]
    rows = [_result(zoo.BASE, "s", "passed"), _result(zoo.BASE, "broken", "failed", kind="wrong")]
    rows += [_result(chosen.spec, *r[:2], **r[2]) for r in results]
    doc = zoo.judge(rows, {mutant: chosen}, [zoo.BASE])
    return doc["table"][0]


def test_a_failure_counts_only_where_the_mutation_fired():
    row = _judge("no-divide", ("s", "failed", {"kind": "wrong", "fired": 0}))
    assert row["caught_by"] == [] and row["failed_not_fired"] == ["s"] and row["verdict"] == "ESCAPED"
    row = _judge("no-divide", ("s", "failed", {"kind": "wrong", "fired": 3}))
    assert row["caught_by"] == ["s"] and row["verdict"] == "caught"


def test_a_scenario_the_base_fails_catches_nothing():
    row = _judge("no-divide", ("broken", "failed", {"kind": "wrong", "fired": 3}))
    assert row["caught_by"] == [] and row["failed_not_fired"] == ["broken"]


def test_a_fired_mutation_the_suite_misses_is_a_blind_spot():
    row = _judge("no-buffer-broadcast", ("s", "passed", {"fired": 2}))
    assert row["caught_by"] == [] and row["fired_but_passed"] == ["s"]


def test_a_hang_counts_only_for_a_mutant_whose_failure_mode_is_a_hang():
    row = _judge("skip-unused", ("s", "failed", {"kind": "hang", "fired": None, "records": 0}))
    assert row["caught_by"] == ["s"] and row["how"]["s"] == "hang"
    row = _judge("no-divide", ("s", "failed", {"kind": "hang", "fired": None, "records": 0}))
    assert row["caught_by"] == []


def test_every_area_has_a_zoo_of_loadable_mutants():
    for area in mutants.ZOO_AREAS:
        area_zoo = mutants.area_zoo(area)
        assert area_zoo.base in area_zoo.controls
        for name, m in area_zoo.mutants.items():
            adapter = registry.load(m.spec)
            assert adapter.area == area and m.bug and "\n" not in m.bug, (area, name)
        if area != "ddp":
            assert len(area_zoo.mutants) >= 8 and all(m.clause for m in area_zoo.mutants.values()), area
            assert registry.load(area_zoo.base).area == area


def test_clause_table_counts_catching_scenarios_per_clause():
    chosen = mutants.area_zoo("bucketer").mutants["calls-twice"]
    base = mutants.area_zoo("bucketer").base
    rows = [_result(base, s, "passed") | {"clauses": c} for s, c in (("a", ["B1", "B2"]), ("b", ["B2", "B7"]), ("c", ["B9"]))]
    rows += [_result(chosen.spec, "a", "failed", kind="wrong", fired=1) | {"clauses": ["B1", "B2"]},
             _result(chosen.spec, "b", "failed", kind="wrong", fired=0) | {"clauses": ["B2", "B7"]},
             _result(chosen.spec, "c", "passed", fired=0) | {"clauses": ["B9"]}]
    doc = zoo.judge(rows, {"calls-twice": chosen}, [base], base=base)
    row = doc["table"][0]
    assert row["clause"] == "B2" and row["by_clause"] == {"B1": ["a"], "B2": ["a"]}
    assert doc["clauses"] == ["B1", "B2", "B7", "B9"] and doc["scenarios_per_clause"] == {"B1": 1, "B2": 2, "B7": 1, "B9": 1}
    assert "Clause × mutant" in zoo._clause_html(doc | {"area": "bucketer"})


@pytest.mark.slow
def test_an_area_zoo_runs_end_to_end(tmp_path):
    """`gradparity zoo --area bucketer` on one mutant: caught where it fired, the base passes."""
    base = mutants.area_zoo("bucketer").base
    code, doc = zoo.zoo("quick", area="bucketer", report_dir=str(tmp_path), mutants=["calls-twice"], controls=[base],
                        console=Console(width=160))
    assert code == 0 and doc["area"] == "bucketer" and doc["controls"][base]["failed"] == 0
    row = doc["table"][0]
    assert row["caught_by"] and not row["failed_not_fired"] and "B2" in row["by_clause"]
    assert "Clause × mutant (bucketer)" in (tmp_path / "zoo.html").read_text()


# -- the zoo itself ---------------------------------------------------------------------------------
# Every test reading the quick zoo runs on one xdist worker: a module fixture is built once per
# worker, and the zoo run is the test suite's longest (two workers each ran it: 2 x 370 s).
ON_ONE_WORKER = pytest.mark.xdist_group("quick-zoo")


@pytest.fixture(scope="module")
def quick_zoo(tmp_path_factory):
    report_dir = tmp_path_factory.mktemp("zoo")
    code, doc = zoo.zoo("quick", report_dir=str(report_dir), timeout_scale=0.2, console=Console(width=160))
    return code, doc, report_dir


@pytest.mark.slow
@ON_ONE_WORKER
def test_every_mutant_is_caught_on_the_quick_profile(quick_zoo):
    code, doc, _ = quick_zoo
    rows = {row["mutant"]: row for row in doc["table"]}
    escaped = {name: (row["failed_not_fired"], row["fired_but_passed"]) for name, row in rows.items() if not row["caught_by"]}
    assert not escaped, f"mutants not caught (failed-not-fired, fired-but-passed): {escaped}"
    for name, scenario in EXPECTED_CATCHER.items():
        assert scenario in rows[name]["caught_by"], f"{name}: caught by {rows[name]['caught_by']}, not by {scenario}"
    assert rows["skip-unused"]["how"]["ddp/unused-on-rank1/branches/w2/fp32"] == "hang"  # the timeout path reported it
    assert set(doc["cover"]) <= {s for row in rows.values() for s in row["caught_by"]}


@pytest.mark.slow
@ON_ONE_WORKER
@pytest.mark.parametrize("control", ["torch-ddp", zoo.BASE])
def test_controls_pass(quick_zoo, control):
    _, doc, _ = quick_zoo
    state = doc["controls"][control]
    assert state["failed"] == 0, state["failures"]
    assert state["passed"] >= 15


@pytest.mark.slow
@ON_ONE_WORKER
def test_refimpl_ddp_passes(quick_zoo):
    """refimpl's DDP is a control too; kept separate so its state reads on its own."""
    _, doc, _ = quick_zoo
    state = doc["controls"]["refimpl-ddp"]
    assert state["failed"] == 0, state["failures"]


@pytest.mark.slow
@ON_ONE_WORKER
def test_reports_carry_the_detection_table(quick_zoo):
    code, doc, report_dir = quick_zoo
    assert code == (1 if doc["escaped"] or doc["failed_controls"] else 0)
    written = json.loads((report_dir / "zoo.json").read_text())
    assert written["schema"] == zoo.SCHEMA and written["profile"] == "quick"
    # the default set is all: the area's own zoo, then the independent one (issue 30)
    assert [row["mutant"] for row in written["table"]] == list(mutants.area_zoo("ddp").mutants)
    fired = [r for r in written["results"] if r["adapter"].endswith(":NoDivide") and r["verdict"] == "failed"]
    # every rank's backward stats, as in `gradparity run`'s report (JSON keys are strings)
    assert fired and all(sum(s["mutation_fired"] for s in r["details"]["backward_stats"].values()) > 0 for r in fired)
    assert all(r["fired"] > 0 for r in fired)
    page = (report_dir / "zoo.html").read_text()
    assert "Detection table" in page and all(name in page for name in mutants.MUTANTS)
