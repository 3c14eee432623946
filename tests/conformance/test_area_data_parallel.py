"""The data_parallel area: catalogue shape, refimpl passes, known-bad implementations are caught
with a message that names the scenario, the step and the parameter, torch's adapter skips on CPU."""

import pytest
import torch

from conformance import catalogue
from conformance.adapters import registry
from conformance.compare import ConformanceError
from conformance.runners import data_parallel as driver

MUTANTS = "conformance.adapters.data_parallel:"


def _get(scenario_id):
    return next(s for s in catalogue.all_scenarios() if s.id == scenario_id)


def test_catalogue_covers_the_issue():
    full = catalogue.select(area="data_parallel", profile="full")
    quick = catalogue.select(area="data_parallel", profile="quick")
    assert {s.id for s in quick} < {s.id for s in catalogue.select(area="data_parallel", profile="standard")}
    assert {s.world_size for s in full} == {1, 2, 3, 4}
    models = {s.model for s in full}
    assert {"dict-in", "tuple-in", "multi-arg", "cnn-bn-eval", "mlp"} <= models
    assert any(sum(s.shard_sizes) % s.world_size for s in full), "uneven splits"
    # bitwise only where every value stays a small integer
    for s in full:
        assert s.tolerance.exact == (s.optimizer == "none" and s.model not in ("transformer", "cnn-bn-eval", "tied")), s.id


@pytest.mark.parametrize("scenario", catalogue.select(area="data_parallel", profile="standard"), ids=str)
def test_refimpl_conforms(scenario):
    checked = driver.check(scenario, "refimpl-data-parallel")
    assert checked.comparisons == 4 * scenario.steps


@pytest.mark.parametrize(
    "mutant, scenario_id, needle",
    [
        ("mutant_drops_last_replica", "data_parallel/plain/mlp/r2/fp32", "layers.0.weight"),
        ("mutant_drops_last_replica", "data_parallel/dict/dict-in/r2/fp32", "lin.weight"),
        ("mutant_averages", "data_parallel/uneven/mlp/r4/fp32", "expected"),
        ("mutant_averages", "data_parallel/bn-eval/cnn-bn-eval/r2/fp32", "conv.weight"),
    ],
)
def test_broken_implementations_are_caught(mutant, scenario_id, needle):
    with pytest.raises(ConformanceError) as info:
        driver.check(_get(scenario_id), MUTANTS + mutant)
    message = str(info.value)
    assert scenario_id in message and "step 0" in message and needle in message
    assert "gradients of the original module differ" in message and "repro: gradparity run" in message


def test_output_structure_is_checked(monkeypatch):
    adapter = registry.load("refimpl-data-parallel")
    real = type(adapter).data_parallel
    monkeypatch.setattr(type(adapter), "data_parallel", lambda self, *a: list(real(self, *a)))
    with pytest.raises(ConformanceError, match="output structure"):
        driver.check(_get("data_parallel/tuple/tuple-in/r2/fp32"), "refimpl-data-parallel")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU skip reason")
def test_torch_data_parallel_skips_on_cpu_with_the_reason():
    adapter = registry.load("torch-data-parallel")
    reason = adapter.unavailable(_get("data_parallel/plain/mlp/r2/fp32"))
    assert reason == "torch.nn.DataParallel needs CUDA devices (torch.cuda.device_count() == 0)"
