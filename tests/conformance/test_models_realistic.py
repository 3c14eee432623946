"""conformance/models/{gpt,llama,moe,resnet,registry}.py: the realistic built-in models are what
they claim (tied weights, grouped-query attention, experts left idle by routing, BatchNorm
buffers), and the registry's declared properties are true of every model it lists."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conformance import catalogue
from conformance.models import data
from conformance.models.moe import MoELayer
from conformance.models.registry import MODELS, REALISTIC, info


@pytest.mark.parametrize("name", REALISTIC)
def test_each_realistic_model_trains_one_step_with_rank_dependent_init(name):
    a = data.build_model(name, {}, seed=0, rank=0, exact=False)
    b = data.build_model(name, {}, seed=0, rank=1, exact=False)
    (x,) = data.make_inputs(name, seed=0, rank=0, step=0, micro=0, size=4)
    data.loss_fn(a(x)).backward()
    assert all(torch.isfinite(p.grad).all() for p in a.parameters() if p.grad is not None)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_gpt_ties_its_output_projection_to_the_token_embedding():
    model = data.build_model("gpt", {}, seed=0, rank=0, exact=False)
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # one parameter, two uses


def test_llama_uses_fewer_key_value_heads_than_query_heads():
    attn = data.build_model("llama", {}, seed=0, rank=0, exact=False).layers[0].attention
    assert attn.wk.out_features == attn.wv.out_features == attn.wq.out_features // 2
    assert not list(data.build_model("llama", {}, seed=0, rank=0, exact=False).buffers())


def _idle_experts(scenario_id: str) -> dict[int, set]:
    """Per rank, (step-0, layer, expert) triples with no token, from rank 0's initial weights."""
    s = next(s for s in catalogue.all_scenarios() if s.id == scenario_id)
    model = data.build_model(s.model, s.kwargs(), seed=s.seed, rank=0, exact=s.exact_data)
    idle = {}
    for rank in range(s.world_size):
        (x,) = data.make_inputs(s.model, seed=s.seed, rank=rank, step=0, micro=0, size=s.shard_size(rank))
        model(x)
        idle[rank] = {(i, e) for i, layer in enumerate(model.moe) for e in range(len(layer.experts))
                      if e not in layer.used_experts}
    return idle


@pytest.mark.parametrize("scenario_id", ["ddp/plain/moe/w2/fp32", "ddp/plain/moe/w4/fp32"])
def test_routing_leaves_an_expert_idle_on_one_rank_that_another_rank_uses(scenario_id):
    idle = _idle_experts(scenario_id)
    everywhere = set.intersection(*idle.values())
    assert any(idle[r] - everywhere for r in idle), idle  # idle on some rank, used on another


def test_the_moe_aux_loss_reaches_the_router_with_its_declared_scale():
    torch.manual_seed(0)
    layer, x = MoELayer(), torch.randn(8, 16)
    grads = []
    for scale in (1.0, 0.5):
        layer.zero_grad()
        layer.aux_loss_scale = scale
        (layer(x) * 0).sum().backward()  # only the aux loss reaches the router
        grads.append(layer.router.weight.grad.clone())
    assert grads[0].abs().sum() > 0 and torch.allclose(grads[1], grads[0] * 0.5)


def test_the_moe_drops_tokens_beyond_an_experts_capacity():
    torch.manual_seed(0)
    layer = MoELayer(experts=2, top_k=1, capacity_factor=0.5)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] += 1.0  # every token prefers expert 0 ...
    x = torch.ones(8, 16)
    out = layer(x)
    assert int((out.abs().sum(dim=1) > 0).sum()) == 2  # ... which takes ceil(0.5 * 8 / 2) = 2 of them


def _has(model: nn.Module, kind) -> bool:
    return any(isinstance(m, kind) for m in model.modules())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_registry_declares_what_each_model_has(name):
    entry = info(name)
    model = data.build_model(name, dict(entry.dropout_kwargs), seed=0, rank=0, exact=False)
    assert entry.has_dropout == any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()), name
    float_buffers = [b for b in model.buffers() if b.is_floating_point()]
    assert entry.has_buffers == bool(float_buffers), name
    assert entry.is_moe == _has(model, MoELayer), name
    uses = [p for m in model.modules() for p in m.parameters(recurse=False)]
    assert entry.has_tied_weights == (len(uses) > len(list(model.parameters()))), name


def test_unknown_models_say_what_exists():
    with pytest.raises(ValueError, match="unknown built-in model 'nope'.*gpt"):
        info("nope")
