"""A Llama-style decoder: RMSNorm, rotary position embeddings, a SwiGLU MLP and grouped-query
attention (fewer key/value heads than query heads), untied input and output embeddings.

Why it is built in: each piece is a different gradient path a data-parallel engine must carry
untouched: RMSNorm's weight-only scale, rotary embeddings computed in forward (no parameter,
no buffer), SwiGLU's three projections, and GQA's key/value projections shared by several
query heads (their gradient sums over the heads of a group before any cross-rank sum).

Plain torch, tiny sizes. The rotary tables are computed in forward, so the model has no
buffers (a buffer rule would otherwise apply to them).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """x / rms(x) * weight (no mean subtraction, no bias), computed in fp32 as Llama does."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def rotary(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, heads, seq, head_dim) by position-dependent angles."""
    seq, dim = x.shape[-2], x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class GroupedQueryAttention(nn.Module):
    """`heads` query heads share `kv_heads` key/value heads (each kv head serves heads/kv_heads)."""

    def __init__(self, d_model: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        self.wq = nn.Linear(d_model, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, d_model, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotary(q), rotary(k)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        return self.wo((att @ v).transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): Llama's gated MLP."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, d_model: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attention_norm = RMSNorm(d_model)
        self.attention = GroupedQueryAttention(d_model, heads, kv_heads)
        self.ffn_norm = RMSNorm(d_model)
        self.feed_forward = SwiGLU(d_model, hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, vocab: int = 32, d_model: int = 16, heads: int = 4, kv_heads: int = 2, hidden: int = 32,
                 layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(LlamaBlock(d_model, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(d_model)
        self.output = nn.Linear(d_model, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, *, rank=0, micro=0):
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))
