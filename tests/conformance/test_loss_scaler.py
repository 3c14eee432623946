"""The replayed dynamic loss scaler (conformance/loss_scaler.py) follows DeepSpeed's DynamicLossScaler."""

from __future__ import annotations

import pytest
import torch

from conformance.loss_scaler import DynamicLossScale


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
