"""The sharded space: its generated profiles cover every allowed pair (and every pair of each engine
tier in rows that tier runs), keep every constraint, and read back."""


import pytest

from conformance.catalogue import select
from conformance.catalogue import sharded as sharded_catalogue
from conformance.space import profiles
from conformance.space.covering import Space, uncovered
from conformance.space.sharded import CONSTRAINTS, DIMENSIONS
from conformance.space.sharded_rows import DEFAULTS, project, scenario
from conformance.spec import Capability as C

SPACE = Space(DIMENSIONS, CONSTRAINTS)
ZERO2 = frozenset({C.NO_SYNC, C.FIND_UNUSED, C.BUCKET_CAP, C.BUFFER_BROADCAST, C.HALF_PRECISION, C.STATE_DICT})


@pytest.fixture(scope="module")
def standard():
    return select(area="sharded", profile="standard")


def test_an_engine_without_the_engine_options_meets_every_portable_pair(standard):
    # refimpl's ZeRO-2 offers no mesh, units, reshard, placement or policy: the rows it runs alone
    # still hold every pair of the other dimensions (parameter dtypes x data, clip, state dicts ...).
    runs = [r for s in standard if s.requires <= ZERO2 and (r := project(s)) is not None]
    assert uncovered(profiles.AREAS["sharded"].space("tier-1"), runs, 2) == []
    assert any(r["precision"] == "fp16" and r["data"] == "large" for r in runs)


def test_refimpl_zero3_meets_every_pair_it_runs(standard):
    # Its adapter refuses a sharded state dict of a dim-1 placement (unavailable): the rows it runs
    # still hold every pair of its tier, clipping far below the norm on an HSDP mesh among them.
    from conformance.adapters.sharded import refimpl_zero3
    from conformance.plan import _capability_skip

    zero3 = refimpl_zero3()
    runs = [r for s in standard if not _capability_skip(zero3, s) and (r := project(s)) is not None]
    assert uncovered(profiles.AREAS["sharded"].space("tier-0"), runs, 2) == []
    assert any(r["clip"] == "below" and r["mesh"] == "hsdp" for r in runs)


def test_a_row_reads_back_and_its_id_says_its_values():
    row = dict(DEFAULTS, model="uneven", world=4, mesh="hsdp", precision="mp-fp32", clip="below", data="cont")
    s = scenario(row, frozenset({"standard", "full"}))
    assert project(s) == row
    assert s.id == "sharded/pairs/uneven/w4/mp-fp32/mesh-hsdp+data-cont+clip-below"
    assert s.options.hsdp_replicas == 2 and s.options.param_dtype == "bfloat16" and s.options.reduce_dtype == "float32"
    assert {C.HSDP, C.MIXED_PRECISION} <= s.requires
    assert dict(s.features)["clip"] < 1 and {"S19", "S22", "S3"} <= set(s.clauses)
    assert s.tolerance.divide == ("pre", "post", "split") and s.tolerance.straight_through is not None


def test_state_dict_rows_round_trip_when_they_say():
    once = scenario(dict(DEFAULTS, state_dict="full"), frozenset({"full"}))
    twice = scenario(dict(DEFAULTS, state_dict="sharded-twice"), frozenset({"full"}))
    assert dict(once.features) == {"save_load_at": 2, "state_dict": "full"} and once.steps == 3
    assert dict(twice.features) == {"save_load_at": (2, 4), "state_dict": "sharded"} and twice.steps == 5
    assert C.STATE_DICT in once.requires and project(twice)["state_dict"] == "sharded-twice"


def test_hand_written_families_count_as_rows():
    pinned = {s.id: s for s in sharded_catalogue.handwritten()}
    row = project(pinned["sharded/shard-placement/mlp/w4/fp32"])
    assert (row["model"], row["units"], row["placement"]) == ("uneven", "children", "dim1")
    assert project(pinned["sharded/hsdp-2x2-rs-accumulate/mlp/w4/fp32"])["accumulation"] == "rs-2"
    assert project(pinned["sharded/no-sync-split/mlp/w2/fp32"]) is None  # a loop switch outside the space


def test_pairs_an_engine_skips_are_uncovered_with_its_capability(standard):
    from conformance.space import coverage

    def skip(s):
        return "" if s.requires <= ZERO2 else "lacks " + ", ".join(sorted(c.value for c in s.requires - ZERO2))

    zero2 = coverage.pairs("sharded", "standard", standard, skip)
    assert 0 < zero2.covered < zero2.possible
    assert all(why.startswith("lacks ") for _, why in zero2.uncovered)  # never "no scenario holds it"
    every = coverage.pairs("sharded", "standard", standard)
    assert every.covered == every.possible and every.excluded > 0
