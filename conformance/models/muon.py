"""Muon as users run it: `torch.optim.Muon` on the 2-D weights, AdamW on everything else.

torch 2.13's Muon takes 2-D parameters only (it orthogonalizes each weight matrix's update by a
Newton-Schulz iteration in bf16); its documentation pairs it with AdamW for biases, norms and
embeddings, so an engine meets Muon as two optimizers stepping one model. `MuonAdamW` is that
pair behind one optimizer's interface (param_groups, state, step, zero_grad, state_dict): the
rank loops, the GradScaler, clipping and the checkpoint round trip drive it like any other, and
the oracle steps the same pair on the engine's judged gradients (same kernels: bitwise).
"""

from __future__ import annotations

import torch

MUON_SETTINGS = {"lr": 2.0**-6, "weight_decay": 2.0**-4}  # momentum 0.95, Nesterov: torch's defaults
ADAMW_SETTINGS = {"lr": 2.0**-6, "weight_decay": 2.0**-4}


class MuonAdamW:
    """Muon over the 2-D parameters, AdamW over the rest, stepped in that order."""

    def __init__(self, params, muon: dict | None = None, adamw: dict | None = None):
        params = list(params)
        matrices = [p for p in params if p.ndim == 2]
        rest = [p for p in params if p.ndim != 2]
        self.parts: list[torch.optim.Optimizer] = []
        if matrices:
            self.parts.append(torch.optim.Muon(matrices, **(muon or MUON_SETTINGS)))
        if rest:
            self.parts.append(torch.optim.AdamW(rest, **(adamw or ADAMW_SETTINGS)))

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for part in self.parts for p, s in part.state.items()}

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure (the rank loops never pass one)")
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        parts = state.get("parts", [])
        if len(parts) != len(self.parts):
            raise ValueError(f"MuonAdamW state has {len(parts)} parts; this optimizer has {len(self.parts)}")
        for part, s in zip(self.parts, parts, strict=True):
            part.load_state_dict(s)
