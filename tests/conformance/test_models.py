"""conformance/models: the oracle's inputs are deterministic, rank-dependent where they must be,
exact on exact data, and every catalogue model name builds (zoo.py, data.py, data_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from conformance import catalogue
from conformance.models import data, data_parallel
from conformance.models.builtin import BUILTIN_MODELS


def _state(model: torch.nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_same_seed_and_rank_build_the_same_model_and_other_ranks_differ():
    a, b = (data.build_model("mlp", {}, seed=3, rank=1) for _ in range(2))
    other = data.build_model("mlp", {}, seed=3, rank=0)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    # rank-dependent on purpose: a missing construction broadcast shows at the first comparison
    assert any(not torch.equal(a.state_dict()[k], other.state_dict()[k]) for k in a.state_dict())


def test_exact_weights_and_inputs_are_small_integers():
    model = data.build_model("mlp", {}, seed=0, rank=0)
    (x,) = data.make_inputs("mlp", seed=0, rank=0, step=0, micro=0, size=4)
    for t in [*model.parameters(), x]:
        assert torch.equal(t, t.round()) and t.abs().max() <= 2
    # shards differ per rank and step (each rank's data is its own)
    (y,) = data.make_inputs("mlp", seed=0, rank=1, step=0, micro=0, size=4)
    (z,) = data.make_inputs("mlp", seed=0, rank=0, step=1, micro=0, size=4)
    assert not torch.equal(x, y) and not torch.equal(x, z)


def test_a_low_precision_model_moves_only_its_fp32_parameters():
    model = data.build_model("mixed-dtype", {}, seed=0, rank=0, dtype="bfloat16")
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.bfloat16, torch.float64}


def test_unknown_names_say_what_exists():
    with pytest.raises(ValueError, match="unknown built-in model 'nope'.*known: .*mlp"):
        data.build_model("nope", {}, seed=0, rank=0)
    with pytest.raises(ValueError, match="unknown optimizer 'lbfgs'"):
        data.make_optimizer("lbfgs", [torch.nn.Parameter(torch.zeros(1))])
    assert data.make_optimizer("none", [torch.nn.Parameter(torch.zeros(1))]) is None


def test_every_model_a_scenario_names_exists():
    dp_names = {s.model for s in catalogue.all_scenarios() if s.area == "data_parallel"}
    other = {s.model for s in catalogue.all_scenarios() if s.area in ("ddp", "sharded")}
    assert dp_names and dp_names <= set(data_parallel.DP_MODELS), dp_names - set(data_parallel.DP_MODELS)
    assert other and other <= set(BUILTIN_MODELS), other - set(BUILTIN_MODELS)
    for name, spec in data_parallel.DP_MODELS.items():
        assert spec.factory is not None or spec.builtin_name in BUILTIN_MODELS, name


def test_data_parallel_batches_are_reproducible():
    one = data_parallel.make_batch("dict-in", seed=1, step=0, batch=4, dtype="float32", device="cpu")
    two = data_parallel.make_batch("dict-in", seed=1, step=0, batch=4, dtype="float32", device="cpu")
    assert data_parallel.structure(one) == data_parallel.structure(two)
    flat_one, flat_two = data_parallel.flatten_output(one), data_parallel.flatten_output(two)
    assert flat_one.keys() == flat_two.keys()
    for k in flat_one:
        a, b = flat_one[k], flat_two[k]
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_map_leaves_keeps_every_container_type_and_visits_every_leaf():
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    nested = {"x": [1, (2, Pair(3, "s"))], "y": None}
    seen = []
    out = data_parallel.map_leaves(nested, lambda leaf: seen.append(leaf) or (leaf * 10 if isinstance(leaf, int) else leaf))
    assert out == {"x": [10, (20, Pair(30, "s"))], "y": None}
    assert type(out["x"][1][1]) is Pair and type(out["x"]) is list
    assert seen == [1, 2, 3, "s", None]


def test_data_scale_multiplies_the_inputs_by_a_power_of_two():
    # issue 38's data-regime dimension: the same model sees inputs x 2**k (exact for small integers)
    import torch

    from conformance.models.data import build_model, make_inputs

    (x,) = make_inputs("mlp", seed=0, rank=0, step=0, micro=0, size=4)
    plain = build_model("mlp", {}, seed=0, rank=0)
    scaled = build_model("mlp", {"data_scale": 3}, seed=0, rank=0)
    assert torch.equal(scaled(x, rank=0, micro=0), plain(x * 8, rank=0, micro=0))
    assert [n for n, _ in scaled.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_every_optimizer_of_the_space_builds():
    import torch

    from conformance.models.data import OPTIMIZER_CLASSES, make_optimizer

    p = torch.nn.Parameter(torch.ones(3))
    for name in OPTIMIZER_CLASSES:
        assert make_optimizer(name, [p]) is not None
    assert make_optimizer("none", [p]) is None
