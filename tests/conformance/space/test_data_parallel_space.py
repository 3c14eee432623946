"""The data_parallel space: its generated profiles cover every allowed pair, keep every constraint,
and read back; the engine that needs CUDA shows every pair uncovered with its reason."""


import pytest

from conformance.catalogue import data_parallel as dp_catalogue
from conformance.catalogue import select
from conformance.catalogue.data_parallel import EXACT_SUMS
from conformance.space.covering import Space
from conformance.space.data_parallel import CONSTRAINTS, DIMENSIONS
from conformance.space.data_parallel_rows import DEFAULTS, project, rows_of, scenario

SPACE = Space(DIMENSIONS, CONSTRAINTS)


@pytest.fixture(scope="module")
def standard():
    return select(area="data_parallel", profile="standard")


def test_a_row_reads_back_and_its_id_says_its_values():
    row = dict(DEFAULTS, model="nested-io", replicas=3, batch="uneven", autocast="bf16", input_grad=True,
               grad_mode="no-grad-first")
    s = scenario(row, frozenset({"standard", "full"}))
    assert project(s) == row
    assert s.id == "data_parallel/pairs/nested-io/r3/fp32/batch-uneven+grad-no-grad-first+input_grad-on+autocast-bf16"
    assert sum(s.shard_sizes) == rows_of("uneven", 3) == 7 and s.world_size == 3
    assert s.kwargs() == {"autocast": True, "input_grad": True, "no_grad_first": True}
    assert s.tolerance.kind == "summation-order" and s.tolerance.straight_through is not None
    assert {"D4", "D5", "D6", "D8", "D11", "D15"} <= set(s.clauses)


def test_exact_sums_only_where_every_sum_is_exact():
    exact = scenario(dict(DEFAULTS, replicas=4, batch="fewer"), frozenset({"standard"}))
    cont = scenario(dict(DEFAULTS, replicas=4, data="cont"), frozenset({"standard"}))
    stepped = scenario(dict(DEFAULTS, optimizer="sgd"), frozenset({"standard"}))
    assert exact.tolerance == EXACT_SUMS and sum(exact.shard_sizes) == 3
    assert cont.tolerance.kind == "summation-order" and not cont.exact_data
    assert stepped.steps == 3 and stepped.tolerance.straight_through is not None


def test_hand_written_scenarios_count_as_rows():
    pinned = {s.id: s for s in dp_catalogue.handwritten()}
    assert project(pinned["data_parallel/fewer-rows/mlp/r4/fp32"])["batch"] == "fewer"
    row = project(pinned["data_parallel/autocast-nested/nested-io/r2/fp32"])
    assert (row["autocast"], row["input_grad"], row["data"]) == ("bf16", True, "cont")
    assert project(pinned["data_parallel/eval-last/cnn-bn-train/r2/fp32"])["mode_switch"] == "eval-last"


def test_a_cuda_only_engine_shows_every_pair_uncovered_with_its_reason(standard):
    from conformance.adapters.data_parallel import torch_data_parallel
    from conformance.space import coverage

    torch_dp = torch_data_parallel()
    cpu = coverage.pairs("data_parallel", "standard", standard, lambda s: torch_dp.unavailable(s) or "")
    assert cpu.covered == 0 and cpu.uncovered
    assert all("CUDA" in why for _, why in cpu.uncovered)
    every = coverage.pairs("data_parallel", "standard", standard)
    assert every.covered == every.possible and every.excluded > 0
