"""A declared dynamic loss scaler (DeepSpeed's `fp16` config), replayed by the oracle step by step.

Why replayed and not bounded: the scaler decides which steps happen at all. A step whose scaled
gradients overflow is skipped on every rank and the scale drops; a wrong scaler (a scale that
never drops, an overflow seen on one rank only, a skipped step that still moves the parameters)
shows as parameters that differ from the replay at the very step, not as noise. The rules are
DeepSpeed 0.19's `DynamicLossScaler` (deepspeed/runtime/fp16/loss_scaler.py) as ZeRO 1-3 drive it:

- the loss is multiplied by the current scale S inside `engine.backward` (`scale_loss`), in the
  loss's own dtype, so the gradients are S times the true ones (bitwise, S a power of two, until
  they overflow); with gradient accumulation (a declared mean over G micro-batches) the loss is
  first divided by G (`loss / gradient_accumulation_steps`, then `scale_if_loss`): the oracle
  scales loss / G by S and does not divide the gradients again, so an overflow is seen where
  the engine sees one (loss·S/G, not loss·S), and 1/S is applied once, at the boundary's step;
- overflow: any inf/NaN in the reduced gradients, on any rank (`has_overflow`, all-reduced with
  MAX); the step is skipped, the gradients are thrown away, and `update_scale(True)` halves S
  once the hysteresis is used up (`max(S / 2, min_scale)`);
- otherwise the fp32 master gradients are multiplied by 1/S (`unscale_and_clip_grads`), the
  optimizer steps, and `update_scale(False)` doubles S after `scale_window` steps without one.

What the oracle cannot know on an overflow step is the engine's discarded gradient (inf/NaN
wherever the arithmetic put them): that backward is not judged (declared), the skipped step is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SOURCE = ("deepspeed/runtime/engine.py backward: loss / gradient_accumulation_steps, then scale_if_loss (× S); "
          "deepspeed/runtime/fp16/loss_scaler.py DynamicLossScaler (scale_loss, update_scale with hysteresis, "
          "scale_window, min_scale) and zero/stage_1_and_2.py step: overflow in the reduced gradients on any rank "
          "skips the step; otherwise grads *= 1/S before the fp32 master step")


@dataclass(frozen=True)
class DynamicLossScale:
    """The configuration (`Semantics.loss_scaler`); `start()` gives the state one run steps through."""

    init_scale: float
    hysteresis: int = 2
    scale_window: int = 1000
    min_scale: float = 1.0

    def start(self) -> LossScalerState:
        return LossScalerState(self)

    def describe(self) -> str:
        return (f"dynamic loss scale from {self.init_scale:g} (hysteresis {self.hysteresis}, window "
                f"{self.scale_window}, min {self.min_scale:g}); an overflow step is skipped and its gradients not judged")


class LossScalerState:
    """DeepSpeed's `DynamicLossScaler` state: the scale, the hysteresis left, the iteration counters."""

    def __init__(self, config: DynamicLossScale):
        self.config = config
        self.scale = float(config.init_scale)
        self.hysteresis = config.hysteresis
        self.iteration = 0
        self.last_overflow = -1

    @staticmethod
    def overflowed(local: list[dict]) -> bool:
        """Whether any rank's gradient holds an inf or NaN (the reduced sum then does too, on every rank)."""
        return any(g is not None and not bool(torch.isfinite(g).all()) for grads in local for g in grads.values())

    def update(self, overflow: bool) -> None:
        """`DynamicLossScaler.update_scale` (consecutive_hysteresis off, DeepSpeed's default)."""
        if overflow:
            if self.config.hysteresis == 1 or self.hysteresis == 1:
                if self.scale == self.config.min_scale:
                    raise ValueError("the loss scale is already at its minimum (DeepSpeed exits the run here)")
                self.scale = max(self.scale / 2.0, self.config.min_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow = self.iteration
        else:
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.config.scale_window == 0:
                self.hysteresis = self.config.hysteresis
                self.scale *= 2.0
        self.iteration += 1
