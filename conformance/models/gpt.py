"""A GPT-style decoder: tied input/output embeddings, learned positions, pre-LayerNorm blocks
with causal self-attention and a GELU MLP, and dropout where GPT-2 has it.

Why it is built in: it is the model most users bring (every default HuggingFace config has
dropout and a tied `lm_head`), and the tie is a weight used twice in one step (embedding
lookup and output projection), whose gradient a reducer must sum over both uses before it
averages across ranks. Dropout is off by default (`dropout=0.0`); scenarios that turn it on
rely on the oracle replaying each rank's RNG stream (`conformance.models.rng`).

Plain torch, tiny sizes (the suite checks semantics, not throughput). The forward takes only
the token ids (`rank`/`micro` are accepted and ignored, as the zoo's signature asks).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head attention over earlier positions only; fused q/k/v projection as in GPT-2."""

    def __init__(self, d_model: int, heads: int, block: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        # A mask computed in forward rather than a buffer: nothing for a buffer rule to sync.
        self.block = block

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, heads: int, block: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, block, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids (batch, block) -> logits (batch, block, vocab); `lm_head.weight is wte.weight`."""

    def __init__(self, vocab: int = 32, block: int = 8, d_model: int = 16, heads: int = 2, layers: int = 2,
                 dropout: float = 0.0):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(block, d_model)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPTBlock(d_model, heads, block, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, used at the input and the output
        self.apply(_gpt2_init)

    def forward(self, idx, *, rank=0, micro=0):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _gpt2_init(module: nn.Module) -> None:
    """GPT-2's initialisation (normal(0, 0.02) weights, zero biases): realistic magnitudes."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, 0.0, 0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, 0.0, 0.02)
