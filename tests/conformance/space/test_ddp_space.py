"""The DDP space: its generated profiles cover every allowed pair, keep every constraint, and read back."""


import pytest

from conformance.catalogue import ddp as ddp_catalogue
from conformance.catalogue import select
from conformance.space import profiles
from conformance.space.covering import Space, generate, uncovered, violations
from conformance.space.ddp import CONSTRAINTS, DIMENSIONS
from conformance.space.ddp_rows import DEFAULTS, project, scenario

SPACE = Space(DIMENSIONS, CONSTRAINTS)


@pytest.fixture(scope="module")
def standard_rows():
    return [r for r in (project(s) for s in select(area="ddp", profile="standard")) if r is not None]


def test_standard_covers_every_allowed_pair(standard_rows):
    assert uncovered(SPACE, standard_rows, 2) == []


def test_generated_rows_keep_every_constraint(standard_rows):
    generated = [project(s) for s in select(area="ddp", profile="standard") if "/pairs/" in s.id or "/core/" in s.id]
    assert generated and None not in generated
    assert violations(SPACE, generated) == []


def test_a_row_reads_back_and_its_id_says_its_values():
    row = dict(DEFAULTS, model="tied", world=3, precision="bf16", data="large", hook="none", optimizer="sgd-wd")
    s = scenario(row, frozenset({"standard", "full"}))
    assert project(s) == row
    assert s.id == "ddp/pairs/tied/w3/bf16/data-large+opt-sgd-wd"
    assert dict(s.model_kwargs)["data_scale"] == 3


def test_quick_covers_its_core_pairs_within_its_budget():
    quick = [r for r in (project(s) for s in select(area="ddp", profile="quick")) if r is not None]
    space = profiles.AREAS["ddp"].space("quick")
    core = [r for r in quick if all(r[d.name] in d.values for d in space.dimensions)]
    assert uncovered(space, core, 2) == []
    assert sum("/core/" in s.id for s in select(area="ddp", profile="quick")) <= profiles.QUICK_BUDGET


def test_generation_is_deterministic():
    pinned = profiles.pinned_rows("ddp", ddp_catalogue.handwritten(), "quick")
    space = profiles.AREAS["ddp"].space("quick")
    assert generate(space, 2, pinned=pinned) == generate(space, 2, pinned=pinned)
