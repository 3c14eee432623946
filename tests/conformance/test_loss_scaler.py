"""The replayed dynamic loss scaler (conformance/oracle/declared/loss_scaler.py) follows DeepSpeed's DynamicLossScaler."""

from __future__ import annotations

import pytest
import torch

from conformance.oracle.declared.loss_scaler import DynamicLossScale


def test_hysteresis_delays_the_halving_and_is_not_refilled_by_a_good_step():
    state = DynamicLossScale(init_scale=2.0**16, hysteresis=2).start()
    state.update(overflow=True)
    assert state.scale == 2.0**16 and state.hysteresis == 1  # first overflow: hysteresis used up, scale kept
    state.update(overflow=False)
    state.update(overflow=True)
    assert state.scale == 2.0**15  # consecutive_hysteresis off: a good step does not refill it


def test_the_scale_doubles_after_a_window_of_good_steps_and_stops_at_its_minimum():
    state = DynamicLossScale(init_scale=4.0, hysteresis=1, scale_window=3, min_scale=2.0).start()
    state.update(overflow=True)  # iteration 0 overflows: 4 -> 2
    assert state.scale == 2.0
    for _ in range(3):
        state.update(overflow=False)  # stable intervals 0, 1, 2
    assert state.scale == 2.0
    state.update(overflow=False)  # stable interval 3 = the window
    assert state.scale == 4.0
    state.update(overflow=True)
    with pytest.raises(ValueError, match="minimum"):
        state.update(overflow=True)  # DeepSpeed raises at min_scale


def test_an_inf_or_nan_on_any_rank_is_an_overflow():
    ok = {"w": torch.ones(2, dtype=torch.float16), "unused": None}
    assert not DynamicLossScale(8.0).start().overflowed([ok, ok])
    assert DynamicLossScale(8.0).start().overflowed([ok, {"w": torch.tensor([1.0, float("inf")], dtype=torch.float16)}])
    assert DynamicLossScale(8.0).start().overflowed([{"w": torch.tensor([float("nan")])}, ok])


def test_with_accumulation_the_loss_divided_by_the_count_is_scaled_not_each_gradient_divided():
    """DeepSpeed's engine.backward: loss / gradient_accumulation_steps, then × S. The oracle's first
    micro-batch gradient is that bit for bit (scaling the whole loss and halving each gradient, the
    model skipped before, is not always: run against deepspeed-zero1 it failed at step 1)."""
    from conformance import catalogue
    from conformance.models.data import build_model, forward_loss, make_inputs
    from conformance.oracle.baseline import compute
    from conformance.semantics import Accumulation, Precision, Semantics

    s = next(x for x in catalogue.select(profile="full") if x.id == "ddp/gas-fp16/mlp/w2/fp16")
    scale = 2.0**7
    sem = Semantics(accumulation=Accumulation.MEAN, precision=Precision.FP32_MASTER,
                    loss_scaler=DynamicLossScale(init_scale=scale, hysteresis=1))
    base = compute(s, sem)
    model = build_model(s.model, s.kwargs(), seed=s.seed, rank=0, dtype=s.dtype, device="cpu", exact=s.exact_data)
    (x,) = make_inputs(s.model, seed=s.seed, rank=0, step=0, micro=0, size=s.shard_size(0), dtype=s.dtype, device="cpu")
    loss = forward_loss(model, s, x, rank=0, step=0, micro=0, device="cpu")
    first = next(e for e in base.events if e.kind == "backward")
    assert not first.synced
    engine = torch.autograd.grad(loss / s.micro_batches * scale, list(model.parameters()), )
    for (n, _), g in zip(model.named_parameters(), engine, strict=True):
        assert torch.equal(first.per_rank[0][n], g), n
    # broken models fail this check: no division by the count (a sum), or 1/S applied per micro-batch
    summed = torch.autograd.grad(forward_loss(model, s, x, rank=0, step=0, micro=0, device="cpu") * scale,
                                 list(model.parameters()))
    assert any(not torch.equal(first.per_rank[0][n], g) for (n, _), g in zip(model.named_parameters(), summed, strict=True))
    assert any(not torch.equal(first.per_rank[0][n], g * (1.0 / scale))
               for (n, _), g in zip(model.named_parameters(), engine, strict=True))
