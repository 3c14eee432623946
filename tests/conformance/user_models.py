"""Users' models for the bring-your-own-model tests: importable by the rank processes
(`tests.conformance.user_models:build`), each with the user's own init, inputs and loss."""

from __future__ import annotations

import random

import torch
from torch import nn
from torch.nn import functional as F


class TinyNet(nn.Module):
    """A user's model: dropout in forward, a LayerNorm, a plain `forward(x)` signature."""

    def __init__(self, dropout: float = 0.1):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 3)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))


def build():
    return TinyNet()


def build_no_dropout():
    return TinyNet(dropout=0.0)


def batch(rank, step, micro):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def loss(output, target):
    return F.cross_entropy(output, target)


def not_a_module():
    return "a string"


class PythonRandom(TinyNet):
    def forward(self, x):
        return super().forward(x) * (1.0 + 0.0 * random.random())


def build_python_random():
    return PythonRandom()
