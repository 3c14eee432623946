"""Every area's generated profiles, the same checks for each (`conformance.space.profiles`):
standard covers every allowed pair, quick its core pairs within the budget, the generated rows
keep every constraint and read back to their ids, and generation is deterministic. What is
particular to an area (its tiers, its rows' plans, an engine's uncovered pairs) is tested beside
its space (`test_<area>_space.py`)."""

import importlib

import pytest

from conformance.catalogue import HANDWRITTEN, select
from conformance.space import profiles
from conformance.space.covering import generate, uncovered, violations

AREAS = tuple(profiles.AREAS)


def _generated(scenarios):
    return [s for s in scenarios if any(f"/{tag}/" in s.id for tag in profiles.TAG.values())]


@pytest.mark.parametrize("area", AREAS)
def test_standard_covers_every_allowed_pair(area):
    standard = select(area=area, profile="standard")
    space = profiles.AREAS[area].space("standard")
    rows = [r for r in map(profiles.AREAS[area].project, standard) if r is not None]
    inside = [r for r in rows if all(r[d.name] in d.values for d in space.dimensions)]  # pinned w8/compile rows read back too
    assert uncovered(space, inside, 2) == []
    assert len(_generated(standard)) < len(standard)  # the pinned scenarios count first


@pytest.mark.parametrize("area", AREAS)
def test_generated_rows_keep_every_constraint_and_read_back(area):
    a = profiles.AREAS[area]
    generated = _generated(select(area=area, profile="standard"))
    rows = [a.project(s) for s in generated]
    assert generated and None not in rows
    assert violations(a.space("standard"), rows) == []
    for s, row in zip(generated, rows, strict=True):
        assert a.to_scenario(row, s.profiles, s.id.split("/")[1]).id == s.id


@pytest.mark.parametrize("area", AREAS)
def test_quick_covers_its_core_pairs_within_its_budget(area):
    quick = select(area=area, profile="quick")
    space = profiles.AREAS[area].space("quick")
    rows = [r for r in map(profiles.AREAS[area].project, quick) if r is not None]
    core = [r for r in rows if all(r[d.name] in d.values for d in space.dimensions)]
    assert uncovered(space, core, 2) == []
    assert sum("/core/" in s.id for s in quick) <= profiles.QUICK_BUDGET  # pinned rows may cover them all


@pytest.mark.parametrize("area", AREAS)
def test_generation_is_deterministic(area):
    space = profiles.AREAS[area].space("quick")
    pinned = [r for r in profiles.pinned_rows(area, HANDWRITTEN[area](), "quick") if profiles.within(space, r)][:5]
    assert pinned and generate(space, 2, pinned=pinned) == generate(space, 2, pinned=pinned)


@pytest.mark.parametrize("area", AREAS)
def test_every_value_left_out_and_every_constraint_says_why(area):
    module = importlib.import_module(f"conformance.space.{area}")
    assert module.LEFT_OUT and all(reason for reason in module.LEFT_OUT.values())
    assert all(c.reason and c.name for c in module.CONSTRAINTS)


def test_every_area_with_a_space_has_hand_written_scenarios_to_pin():
    assert set(AREAS) <= set(HANDWRITTEN)


@pytest.mark.parametrize("area", AREAS)
def test_full_rows_read_back_so_full_covers_every_allowed_pair(area):
    # A row with one of full's own values (world size 8, compile, offload ...) must read back as a
    # row: the full profile's pair coverage counted 214 DDP pairs uncovered when it did not.
    full = select(area=area, profile="full")
    rows = [r for r in map(profiles.AREAS[area].project, full) if r is not None]
    assert uncovered(profiles.AREAS[area].space("full"), rows, 2) == []
