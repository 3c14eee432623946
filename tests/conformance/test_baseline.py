"""The oracle against hand-computed expectations (no processes)."""

import torch

from conformance.models.data import build_model, loss_fn, make_inputs
from conformance.oracle import baseline
from conformance.spec import Scenario, WrapOptions


def test_world_size_one_is_plain_training():
    s = Scenario("ddp/t/mlp/w1/fp32", "ddp", "mlp", world_size=1, steps=1, optimizer="none")
    b = baseline.compute(s)
    model = build_model("mlp", {}, seed=0, rank=0)
    (x,) = make_inputs("mlp", seed=0, rank=0, step=0, micro=0, size=4)
    loss_fn(model(x)).backward()
    grads = b.events[0].per_rank[0]
    for name, p in model.named_parameters():
        assert torch.equal(grads[name], p.grad), name


def test_average_over_ranks_and_unused_parameters():
    s = Scenario("ddp/t/branches/w2/fp32", "ddp", "branches", (("mode", "unused-on-rank1"),), world_size=2,
                 steps=1, options=WrapOptions(find_unused_parameters=True))
    b = baseline.compute(s)
    synced = b.events[0]
    assert synced.synced and synced.per_rank[0] is synced.per_rank[1]
    assert synced.per_rank[0]["never.weight"] is None, "a parameter no rank uses must stay None"
    # `extra` is used on rank 0 only: the average is rank 0's gradient / 2
    model = build_model("branches", {"mode": "unused-on-rank1"}, seed=0, rank=0)
    (x,) = make_inputs("branches", seed=0, rank=0, step=0, micro=0, size=4)
    loss_fn(model(x, rank=0)).backward()
    assert torch.equal(synced.per_rank[0]["extra.weight"], model.extra.weight.grad / 2)


def test_no_sync_events_are_per_rank_local_sums():
    s = Scenario("ddp/t/mlp/w2/fp32", "ddp", "mlp", world_size=2, steps=1, micro_batches=2)
    b = baseline.compute(s)
    local, synced = b.events[0], b.events[1]
    assert not local.synced and synced.synced
    assert not torch.equal(local.per_rank[0]["layers.0.weight"], local.per_rank[1]["layers.0.weight"])
    # synced = (local_0 + g_0' + local_1 + g_1') / 2: recompute rank sums by hand
    sums = []
    for rank in range(2):
        model = build_model("mlp", {}, seed=0, rank=0)
        for micro in range(2):
            (x,) = make_inputs("mlp", seed=0, rank=rank, step=0, micro=micro, size=4)
            loss_fn(model(x)).backward()
        sums.append(model.layers[0].weight.grad)
    assert torch.equal(synced.per_rank[0]["layers.0.weight"], sums[0] / 2 + sums[1] / 2)


def test_rank_dependent_initialisation_and_rank0_state():
    a = build_model("cnn-bn", {}, seed=3, rank=0)
    b = build_model("cnn-bn", {}, seed=3, rank=1)
    assert not torch.equal(a.conv.weight, b.conv.weight)
    assert not torch.equal(a.bn.running_mean, b.bn.running_mean)
    s = Scenario("ddp/t/cnn-bn/w2/fp32", "ddp", "cnn-bn", world_size=2, steps=1, seed=3)
    init = baseline.compute(s).init_params
    assert torch.equal(init["conv.weight"], a.conv.weight)


def test_computed_once_per_scenario():
    s = Scenario("ddp/t/tied/w2/fp32", "ddp", "tied", world_size=2, steps=1)
    assert baseline.compute(s) is baseline.compute(s)
