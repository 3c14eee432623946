"""The declared rule `construction_sync: first-optimizer-step` (torchft's async quorum), modelled exactly."""

from __future__ import annotations

import torch

from conformance import catalogue
from conformance.models.data import build_model, loss_fn, make_inputs
from conformance.oracle.baseline import compute
from conformance.semantics import ConstructionSync, Semantics


def test_step_zero_is_rank_zeros_own_gradient_and_then_everyone_holds_its_state():
    s = next(x for x in catalogue.select(profile="standard") if x.id == "ddp/plain/mlp/w2/fp32")
    base = compute(s, Semantics(construction_sync=ConstructionSync.FIRST_STEP))
    # construction: each rank holds its own (rank-dependent) parameters
    assert not all(torch.equal(base.init_for(0)[0][n], base.init_for(1)[0][n]) for n in base.init_params)
    # step 0: rank 0's own gradient at its own parameters, not an average with rank 1's
    model = build_model(s.model, s.kwargs(), seed=s.seed, rank=0, dtype=s.dtype, device="cpu", exact=s.exact_data)
    (x,) = make_inputs(s.model, seed=s.seed, rank=0, step=0, micro=0, size=s.shard_size(0), dtype=s.dtype, device="cpu")
    loss_fn(model(x, rank=0, micro=0)).backward()
    first = next(e for e in base.events if e.kind == "backward")
    for n, p in model.named_parameters():
        assert torch.equal(first.per_rank[1][n], p.grad), n
    plain = next(e for e in compute(s).events if e.kind == "backward")
    assert any(not torch.equal(plain.per_rank[0][n], first.per_rank[0][n]) for n in first.per_rank[0])


def test_production_oracle_models_the_first_step_rule_and_rejects_the_halved_gradient():
    """The features oracle (clip, scaler, toggles ... under torchft's async quorum): step 0 is rank 0's
    own gradient at its own parameters; torchft 0.2's g_rank0 / W (the finding) is not that."""
    from conformance.oracle import baseline_features

    s = next(x for x in catalogue.select(profile="standard") if x.id == "ddp/clip-grad-norm/mlp/w2/fp32")
    base = baseline_features.compute(s, Semantics(construction_sync=ConstructionSync.FIRST_STEP))
    assert not all(torch.equal(base.init_for(0)[0][n], base.init_for(1)[0][n]) for n in base.init_params)
    model = build_model(s.model, s.kwargs(), seed=s.seed, rank=0, dtype=s.dtype, device="cpu", exact=s.exact_data)
    for n, p in model.named_parameters():
        p.data.copy_(base.init_for(0)[0][n])
    (x,) = make_inputs(s.model, seed=s.seed, rank=0, step=0, micro=0, size=s.shard_size(0), dtype=s.dtype, device="cpu")
    loss_fn(model(x, rank=0, micro=0)).backward()
    first = next(e for e in base.events if e.kind == "backward")
    for n, p in model.named_parameters():
        assert torch.equal(first.per_rank[1][n], p.grad), n
        assert not torch.equal(first.per_rank[1][n], p.grad / s.world_size), n  # the finding's value differs
    plain = next(e for e in baseline_features.compute(s).events if e.kind == "backward")
    assert any(not torch.equal(plain.per_rank[0][n], first.per_rank[0][n]) for n in first.per_rank[0])
    # after step 0 every rank holds one state (rank 0's, stepped)
    stepped = next(e for e in base.events if e.kind == "step")
    assert all(torch.equal(stepped.per_rank[0][n], stepped.per_rank[1][n]) for n in stepped.per_rank[0])
