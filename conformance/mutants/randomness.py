"""A mutant that moves the user's random-number stream: caught by the dropout scenarios
(`ddp/dropout/gpt/...`, conformance/catalogue/realistic.py).

`DrawsBetweenForwards` draws one number from torch's default generator before every forward
(as an engine that jitters its bucket timing, or samples a seed for its own use, from the
global generator would). Its gradients are still the average of what each rank computed, but
every dropout mask differs from what one process training the same model from the same seed
draws: the oracle, which knows where each rank's stream must be, says so. It fires only where
that changes a value: a module with active dropout in training mode.
"""

from __future__ import annotations

import torch
from torch import nn

from conformance.mutants.base import BucketedDDP


def _draws_in_forward(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in module.modules())


class DrawsBetweenForwards(BucketedDDP):
    bug = "draws a random number from the global generator before each forward: every dropout mask moves"

    def forward(self, *inputs, **kwargs):
        torch.rand(1)
        if _draws_in_forward(self.module) and torch.is_grad_enabled():
            self._fired()
        return super().forward(*inputs, **kwargs)
