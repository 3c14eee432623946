"""The sharded area: the DDP catalogue re-labelled and filtered, honest capabilities, and
refimpl-sharded / FSDP / FSDP2 driven through the DDP runner on warm pools."""

import re
from pathlib import Path

import pytest

from conformance import area, catalogue
from conformance.adapters import registry
from conformance.case import Case
from conformance.judge.compare import ConformanceError
from conformance.pipeline import check, run_case
from conformance.spec import Capability as C
from tests.conformance.area_cases import mutant_spec
from tests.conformance.area_cases import scenario as _get


def test_catalogue_is_the_ddp_contract_minus_ddp_machinery():
    full = catalogue.select(area="sharded", profile="full")
    assert all(s.id.startswith("sharded/") and s.area == "sharded" for s in full)
    assert not any(s.options.comm_hook or s.options.static_graph or s.options.gradient_as_bucket_view for s in full)
    assert not any(C.SPARSE in s.requires for s in full)
    ddp_ids = {s.id.replace("ddp/", "sharded/", 1) for s in catalogue.select(area="ddp", profile="full")}
    from conformance.catalogue import sharded_families  # issue 26 part B: S15-S18
    from conformance.catalogue.sharded import (
        accumulation_and_usage_scenarios,  # issue 30's block: checklist cells the DDP-derived scenarios leave empty
        fsdp_depth_scenarios,  # issue 26's block: FSDP-only options
    )

    depth = {s.id for s in fsdp_depth_scenarios()} | {s.id for s in accumulation_and_usage_scenarios()}
    depth |= {s.id for s in sharded_families.scenarios()}
    import importlib

    for block in ("sharded_precision", "sharded_clip", "sharded_hsdp"):  # issue 26 (A, S21), issue 25: blocks of their own
        depth |= {s.id for s in importlib.import_module(f"conformance.catalogue.{block}").scenarios()}
    generated = {s.id for s in full if s.id.split("/")[1] in ("core", "pairs", "triples")}  # conformance.space.sharded
    assert {s.id for s in full} - depth - generated <= ddp_ids
    assert all(s.options.units or s.options.reshard_after_forward is False or s.options.hsdp_replicas or "skew" in s.id
               for s in fsdp_depth_scenarios())
    assert all(C.BUFFER_BROADCAST in s.requires for s in full if s.model in ("buffered", "cnn-bn"))
    assert {s.world_size for s in catalogue.select(area="sharded", profile="standard")} == {1, 2, 3, 4}
    quick = catalogue.select(area="sharded", profile="quick")
    # issue 30: + one scenario per mutant whose bug shows at 2 ranks, the idle rank inside no_sync()
    # included, and one w2 scenario for each of issue 26's families (S15-S21) (issue 25: + clip-grad-norm, S22)
    assert 3 <= len(quick) <= 22


def test_capabilities_are_declared_per_adapter():
    ref, fsdp, fsdp2 = (registry.load(n) for n in ("refimpl-sharded", "torch-fsdp", "torch-fsdp2"))
    assert {a.area for a in (ref, fsdp, fsdp2)} == {"sharded"}
    assert C.BUCKET_CAP in ref.capabilities and C.BUFFER_BROADCAST in ref.capabilities
    for a in (fsdp, fsdp2):
        assert C.NO_SYNC in a.capabilities
        assert C.BUCKET_CAP not in a.capabilities and C.BUFFER_BROADCAST not in a.capabilities
        assert C.SPARSE not in a.capabilities


@pytest.mark.slow
@pytest.mark.parametrize("scenario_id", [
    "sharded/adam/mlp/w2/fp32", "sharded/no-sync/mlp/w2/fp32", "sharded/bucket-over-cap/big-param/w2/fp32",
    "sharded/unused-on-rank1/branches/w2/fp32",
])
def test_refimpl_sharded_conforms(session, scenario_id):
    assert check(_get(scenario_id), "refimpl-sharded", session).comparisons > 5


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["torch-fsdp", "torch-fsdp2"])
def test_torch_fsdp_conforms_on_the_basics(session, adapter):
    for scenario_id in ("sharded/plain/mlp/w2/fp32", "sharded/no-sync/mlp/w2/fp32"):
        assert check(_get(scenario_id), adapter, session).comparisons > 5


@pytest.mark.slow
def test_fsdp_zero_filled_grads_are_reported(session):
    """FSDP1's flat gradient zero-fills a parameter no rank used (the contract wants None)."""
    with pytest.raises(ConformanceError, match=r"never\.weight: expected grad None"):
        check(_get("sharded/unused-on-all/branches/w2/fp32"), "torch-fsdp", session)


# -- the zoo: one known-bad engine per clause of docs/contracts/sharded.md ---------------------------
def test_every_clause_has_a_mutant_and_a_scenario():
    from conformance.mutants import sharded as zoo

    standard = catalogue.select(area="sharded", profile="standard")
    clauses = {c for s in standard for c in s.clauses}
    from conformance.mutants.independent import sharded as independent  # issue 30: S14

    own = {cls.clause for cls in zoo.MUTANTS.values()}
    # The clauses are the rows of the contract page; every one has standard scenarios and a mutant.
    page = (Path(__file__).resolve().parents[2] / "docs" / "contracts" / "sharded.md").read_text()
    documented = set(re.findall(r"^\| (S\d+) \| [^|]", page.split("## Dimension checklist")[0], flags=re.M))
    assert clauses == documented and {f"S{i}" for i in range(1, 19)} <= documented
    assert own | {cls.clause for cls in independent.MUTANTS.values()} >= documented
    assert _get("sharded/plain/mlp/w3/fp32").clauses.count("S3") == 1  # padded shards at w3
    assert "S12" in _get("sharded/plain/mlp/w3/fp32").clauses  # and their local shards (conformance/judge/shards.py)
    assert "S3" not in _get("sharded/plain/mlp/w2/fp32").clauses


# mutant -> (a scenario of the clause it breaks, what the failure says); a cheap subset runs here,
# `gradparity zoo --area sharded` runs them all.
CAUGHT = {
    "floor-chunks": ("sharded/plain/cnn-bn/w2/fp32", "head.bias"),
    "batch-weighted": ("sharded/uneven/mlp/w2/fp32", "rank 0"),
    "padding-not-zero": ("sharded/plain/mlp/w3/fp32", "local grad shard is not its slice"),
    "stale-regather": ("sharded/nested-reshard/mlp/w2/fp32", "step 1"),
    # issue 25: a shard clipped by its own norm (pytorch/pytorch#170862), outside the derived clip bound (S22)
    "clip-local-norm": ("sharded/clip-grad-norm/mlp/w2/fp32", "after optimizer step 0"),
    # issue 26 part A: the mixed-precision policy (S19) and reshard_after_forward=k (S20)
    "reduce-in-param-dtype": ("sharded/mp-bf16-reduce-fp32/mlp/w2/fp32", "layers.0.weight"),
    "grad-through-param-dtype": ("sharded/mp-bf16-reduce-fp32/mlp/w2/fp32", "layers.0.weight"),
    "no-cast-back": ("sharded/mp-bf16-reduce-bf16/mlp/w2/fp32", "layers.0.weight"),
    "regather-wrong-rows": ("sharded/nested-reshard-to-2/mlp/w4/fp32", "outside the envelope"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_broken_engines_are_caught_where_they_fire(session, name):
    scenario_id, needle = CAUGHT[name]
    result = run_case(Case(_get(scenario_id), mutant_spec("sharded", name)), session)
    assert result.verdict == "failed", result.message
    assert scenario_id in result.message and needle in result.message, result.message
    fired = [s["mutation_fired"] for s in result.details["backward_stats"].values()]
    assert sum(fired) > 0 and result.fired == sum(fired), f"{name} failed without its bug firing"


@pytest.mark.slow
def test_the_zoo_base_passes_through_the_same_path(session):
    from conformance.mutants import sharded as zoo

    # each mutant's own control: ZeRO-2's `correct`, or `correct3` for the ZeRO-3 mutants
    bases = {(s, getattr(zoo.MUTANTS[name], "base", "conformance.mutants.sharded:correct")) for name, (s, _) in CAUGHT.items()}
    for scenario_id, base in sorted(bases):
        result = run_case(Case(_get(scenario_id), base), session)
        assert result.verdict == "passed" and result.checked.comparisons > 5, result.message
        assert all(s["mutation_fired"] == 0 for s in result.details["backward_stats"].values())


def test_sharded_judge_fails_on_one_ulp_and_passes_the_control():
    """The sharded area is judged by the DDP contract check: the same one-element meta-test."""
    from conformance.judge.contract import check_records
    from tests.conformance import test_compare_meta as meta

    assert area.AREAS["sharded"].judge is area.AREAS["ddp"].judge
    scenario = meta.SCENARIO.with_(id="sharded/meta/hand-built/w2/fp32", area="sharded")
    baseline, records = meta._oracle()
    baseline.scenario = scenario
    assert check_records(scenario, "meta", baseline, records).comparisons > 0
    records[1]["events"][0]["values"] = dict(records[1]["events"][0]["values"], b=meta._ulp_up(records[1]["events"][0]["values"]["b"]))
    with pytest.raises(ConformanceError, match="rank 1"):
        check_records(scenario, "meta", baseline, records)
