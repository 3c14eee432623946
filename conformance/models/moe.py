"""A top-k routed mixture-of-experts language model: a router picks `top_k` of `experts` MLPs per
token, each expert takes at most `capacity` tokens (the rest are dropped, as in GShard/Switch),
and a load-balancing auxiliary loss (Switch Transformer's E·Σ f_e·P_e) joins the gradient.

Why it is built in: MoE is where data-parallel engines break today. With a handful of tokens
per rank, routing leaves some experts without a token on some ranks and steps: their
parameters are unused there (pytorch#158719, #174862; torchtitan#2747), yet every rank must
end with the average over all ranks, the idle ranks contributing zero. Expert gradients are
easy to scale by the wrong group (pytorch#167178, Megatron#5956, DeepSpeed#6546), and the aux
loss by the wrong factor (Megatron#3769, NeMo-Automodel#1408).

The aux loss joins the backward the way Megatron-LM's `MoEAuxLossAutoScaler` does: the layer's
output carries it, and backward hands the aux loss a gradient of `aux_loss_scale` (1.0: the
rank's loss is L = task + aux). An engine that scales it (Megatron sets it to its loss scale)
owns that choice; scaled again by the engine's average it is wrong (the `aux-scaled-twice`
mutant, `conformance.mutants.moe`).

`used_experts` records, per layer, which experts got a token in the last forward, so tests can
show that the scenarios really leave experts unused on some ranks.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class AuxLossScaler(torch.autograd.Function):
    """Identity on `output`; backward gives `aux` the gradient `scale` (Megatron-LM's auto-scaler)."""

    @staticmethod
    def forward(ctx, output, aux, scale: float):
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return output.clone()

    @staticmethod
    def backward(ctx, grad_output):
        grad_aux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_output.device)
        return grad_output, grad_aux, None


class Expert(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_in = nn.Linear(d_model, hidden)
        self.w_out = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.w_out(F.gelu(self.w_in(x)))


class MoELayer(nn.Module):
    """Tokens (n, d) -> (n, d): top-k routing with capacity, plus the aux loss (see the module doc)."""

    def __init__(self, d_model: int = 16, experts: int = 8, top_k: int = 2, hidden: int = 32,
                 capacity_factor: float = 1.0, aux_coeff: float = 0.01):
        super().__init__()
        self.top_k, self.capacity_factor, self.aux_coeff = top_k, capacity_factor, aux_coeff
        self.aux_loss_scale = 1.0  # the gradient the aux loss gets (Megatron's main_loss_backward_scale)
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, hidden) for _ in range(experts))
        self.used_experts: list[int] = []

    def forward(self, x):
        n, count = x.shape[0], len(self.experts)
        probs = F.softmax(self.router(x), dim=-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        gates = top_p / top_p.sum(dim=-1, keepdim=True)
        capacity = math.ceil(self.capacity_factor * n * self.top_k / count)
        out = torch.zeros_like(x)
        self.used_experts = []
        for e, expert in enumerate(self.experts):
            token, slot = (top_i == e).nonzero(as_tuple=True)
            # First choices before second ones, then token order; beyond capacity a token is dropped.
            keep = torch.argsort(slot * n + token, stable=True)[:capacity]
            token, slot = token[keep], slot[keep]
            if token.numel() == 0:
                continue  # no token for this expert here: its parameters are unused in this forward
            self.used_experts.append(e)
            out = out.index_add(0, token, expert(x[token]) * gates[token, slot].unsqueeze(-1))
        # Switch Transformer's load-balancing loss: fraction of first choices times mean probability.
        fraction = F.one_hot(top_i[:, 0], count).to(probs.dtype).mean(dim=0)
        aux = self.aux_coeff * count * (fraction * probs.mean(dim=0)).sum()
        return AuxLossScaler.apply(out, aux, self.aux_loss_scale)


class MoEModel(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab), with `layers` pre-norm MoE blocks."""

    def __init__(self, vocab: int = 32, d_model: int = 16, layers: int = 2, experts: int = 8, top_k: int = 2,
                 hidden: int = 32, capacity_factor: float = 1.0, aux_coeff: float = 0.01):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.moe = nn.ModuleList(MoELayer(d_model, experts, top_k, hidden, capacity_factor, aux_coeff)
                                 for _ in range(layers))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx, *, rank=0, micro=0):
        h = self.embed(idx)
        b, t, d = h.shape
        for norm, moe in zip(self.norms, self.moe, strict=True):
            h = h + moe(norm(h).reshape(b * t, d)).view(b, t, d)
        return self.head(h)
