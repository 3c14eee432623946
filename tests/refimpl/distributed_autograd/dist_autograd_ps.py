"""A tiny parameter server for the optimizer test and the benchmark (runs on the PS worker)."""

from __future__ import annotations

import torch
from torch.distributed import rpc

PARAMS: dict[str, torch.Tensor] = {}


def create_params(seed: int, dim: int) -> list[rpc.RRef]:
    g = torch.Generator().manual_seed(seed)
    PARAMS["w"] = torch.randn(dim, dim, generator=g).requires_grad_()
    PARAMS["b"] = torch.randn(dim, generator=g).requires_grad_()
    return [rpc.RRef(PARAMS["w"]), rpc.RRef(PARAMS["b"])]


def forward(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ PARAMS["w"] + PARAMS["b"])


def snapshot() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in PARAMS.items()}
