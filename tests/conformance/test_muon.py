"""Muon as users run it (conformance.models.muon): Muon on the 2-D weights, AdamW on the rest."""

from __future__ import annotations

import io

import pytest
import torch

from conformance.models.data import build_model, loss_fn, make_inputs, make_optimizer
from conformance.models.muon import MuonAdamW


def _stepped(opt_name: str, steps: int = 2, seed: int = 0):
    model = build_model("mlp", {}, seed=seed, rank=0)
    opt = make_optimizer(opt_name, model.parameters())
    for step in range(steps):
        (x,) = make_inputs("mlp", seed=seed, rank=0, step=step, micro=0, size=4, dtype="float32", device="cpu")
        loss_fn(model(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def test_muon_takes_the_matrices_and_adamw_the_rest():
    model = build_model("mlp", {}, seed=0, rank=0)
    opt = make_optimizer("muon", model.parameters())
    muon, adamw = opt.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert {id(p) for p in muon.param_groups[0]["params"]} == {id(p) for p in model.parameters() if p.ndim == 2}
    assert {id(p) for p in adamw.param_groups[0]["params"]} == {id(p) for p in model.parameters() if p.ndim == 1}
    assert len(opt.param_groups) == 2


def test_a_step_is_torchs_muon_update_not_adamws():
    model, opt = _stepped("muon", steps=1)
    by_hand = build_model("mlp", {}, seed=0, rank=0)
    mats = [p for p in by_hand.parameters() if p.ndim == 2]
    ref = torch.optim.Muon(mats, lr=2.0**-6, weight_decay=2.0**-4)
    (x,) = make_inputs("mlp", seed=0, rank=0, step=0, micro=0, size=4, dtype="float32", device="cpu")
    loss_fn(by_hand(x)).backward()
    ref.step()
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        if p.ndim == 2:
            assert torch.equal(p, q), name
    adamw_only, _ = _stepped("adamw", steps=1)
    assert not torch.equal(model.layers[0].weight, adamw_only.layers[0].weight)


def test_the_state_round_trips_through_torch_save_with_weights_only():
    model, opt = _stepped("muon")
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    fresh = MuonAdamW(model.parameters())
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert len(fresh.state) == len(opt.state) == len(list(model.parameters()))
    for p in model.parameters():
        for key, value in opt.state[p].items():
            assert torch.equal(torch.as_tensor(fresh.state[p][key]), torch.as_tensor(value)), key
    with pytest.raises(ValueError, match="1 parts; this optimizer has 2"):
        fresh.load_state_dict({"parts": [opt.state_dict()["parts"][0]]})
