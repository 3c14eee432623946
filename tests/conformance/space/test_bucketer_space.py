"""The bucketer space: its generated profiles cover every allowed pair (standard) and triple (full),
keep every constraint, read back, and build plans that hold what their rows say."""

import pytest

from conformance.catalogue import bucketer as cat
from conformance.catalogue import select
from conformance.catalogue.profiles import FULL, STANDARD
from conformance.space import coverage, profiles
from conformance.space.bucketer import CONSTRAINTS, DIMENSIONS
from conformance.space.bucketer_rows import DEFAULTS, project, scenario
from conformance.space.covering import Space, uncovered, violations
from conformance.spec import Capability as C

SPACE = Space(DIMENSIONS, CONSTRAINTS)


@pytest.fixture(scope="module")
def standard():
    return select(area="bucketer", profile="standard")


def _generated(scenarios):
    return [s for s in scenarios if any(f"/{tag}/" in s.id for tag in profiles.TAG.values())]


def test_standard_covers_every_allowed_pair(standard):
    rows = [r for r in map(project, standard) if r is not None]
    assert uncovered(SPACE, rows, 2) == []
    assert len(_generated(standard)) < len(standard)  # the pinned scenarios count first


def test_full_covers_every_allowed_triple():
    full = select(area="bucketer", profile="full")
    assert uncovered(profiles.AREAS["bucketer"].space("full"), [r for r in map(project, full) if r], 3) == []
    assert any(s.world_size == 8 for s in full)


def test_generated_rows_keep_every_constraint_and_read_back(standard):
    for s in _generated(standard) + _generated(select(area="bucketer", profile="full")):
        row = project(s)
        assert row is not None, s.id
        assert scenario(row, s.profiles, s.id.split("/")[1]).id == s.id
    rows = [project(s) for s in _generated(standard)]
    assert violations(SPACE, rows) == []


def test_a_row_reads_back_and_its_id_says_its_values():
    row = dict(DEFAULTS, world=3, dtypes="int64", group="world-and-pairs", form="keyword", empty="yes", rounds=2)
    s = scenario(row, STANDARD | FULL)
    assert project(s) == row
    assert s.id == "bucketer/pairs/small/w3/int64/group-world-and-pairs+empty-yes+form-keyword+rounds-2"
    assert s.steps == 2 and s.options.bucket_cap_mb == 0.0005 and dict(s.model_kwargs)["keyword"] is True
    assert {cat.GROUPS, cat.FORMS, cat.EMPTY, cat.LIFECYCLE} <= set(s.clauses) and C.BUCKET_CAP in s.requires


def test_each_plan_holds_what_its_row_says(standard):
    for s in _generated(standard):
        row, calls = project(s), cat.plan(s)
        assert all(c.callback for c in calls) == (row["callbacks"] == "all") and any(c.callback for c in calls)
        big = [c for c in calls if c.numel and all(cat.must_be_immediate(s, c, r) for r in range(s.world_size))]
        assert bool(big) == (row["big"] == "yes") or row["cap"] != "small", s.id
        if row["empty"] == "yes" and row["cap"] == "small":
            # the zero-element calls follow a queued input of their bucket
            at = next(i for i, c in enumerate(calls) if c.numel == 0)
            before = calls[at - 1]
            assert (before.dtype, before.group) == (calls[at].dtype, calls[at].group)
            assert cat.must_be_deferred(s, before)


def test_hand_written_scenarios_count_as_rows():
    pinned = {s.id: s for s in cat.handwritten()}
    row = project(pinned["bucketer/groups/off/w3/fp32"])
    assert (row["cap"], row["group"], row["big"]) == ("off", "world-and-pairs", "no")
    assert project(pinned["bucketer/keyword-groups/0.0005mb/w2/fp32"])["form"] == "keyword"
    assert project(pinned["bucketer/teardown-fifo/0.0005mb/w2/fp32-fp64"]) is None  # several inputs at teardown


def test_pairs_an_adapter_skips_are_uncovered_with_its_capability(standard):
    def skip(s):  # an adapter without HALF_PRECISION (fp16/bf16 skipped by the plan)
        return "lacks half_precision" if C.HALF_PRECISION in s.requires else ""

    without = coverage.pairs("bucketer", "standard", standard, skip)
    assert 0 < without.covered < without.possible
    assert {why for _, why in without.uncovered} == {"lacks half_precision"}
    assert any(p.get("dtypes") == "bf16" for p, _ in without.uncovered)
    every = coverage.pairs("bucketer", "standard", standard)
    assert every.covered == every.possible and every.excluded > 0


def test_a_bucketer_without_half_precision_meets_every_other_pair(standard):
    runs = [r for s in standard if C.HALF_PRECISION not in s.requires and (r := project(s)) is not None]
    assert uncovered(profiles.AREAS["bucketer"].space("tier-0"), runs, 2) == []
