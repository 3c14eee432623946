"""The DDP space: its generated profiles cover every allowed pair, keep every constraint, and read back."""


import pytest

from conformance.catalogue import select
from conformance.space.covering import Space
from conformance.space.ddp import CONSTRAINTS, DIMENSIONS
from conformance.space.ddp_rows import DEFAULTS, project, scenario

SPACE = Space(DIMENSIONS, CONSTRAINTS)


@pytest.fixture(scope="module")
def standard_rows():
    return [r for r in (project(s) for s in select(area="ddp", profile="standard")) if r is not None]


def test_a_row_reads_back_and_its_id_says_its_values():
    row = dict(DEFAULTS, model="tied", world=3, precision="bf16", data="large", hook="none", optimizer="sgd-wd")
    s = scenario(row, frozenset({"standard", "full"}))
    assert project(s) == row
    assert s.id == "ddp/pairs/tied/w3/bf16/data-large+opt-sgd-wd"
    assert dict(s.model_kwargs)["data_scale"] == 3
