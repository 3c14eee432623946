"""The built-in models: small models, each built to exercise one part of the data-parallel contract.

Every model's `forward(x, *, rank=0, micro=0)` accepts the rank and micro-batch index so that
control flow can depend on them (parameters unused on some ranks, or only in early
micro-batches). The baseline passes the same values when it replays each rank's shard.
Models are deliberately tiny: the suite checks semantics, not throughput.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class MLP(nn.Module):
    """A plain multi-layer perceptron; `depth`/`width` size it for bucket-cap scenarios."""

    def __init__(self, depth: int = 3, width: int = 16, d_in: int = 8, d_out: int = 4):
        super().__init__()
        dims = [d_in] + [width] * (depth - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:], strict=False))

    def forward(self, x, *, rank=0, micro=0):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class ConvBN(nn.Module):
    """A CNN with BatchNorm: per-shard batch statistics and running-stat buffers."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(2, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, 3)

    def forward(self, x, *, rank=0, micro=0):
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(h.mean(dim=(2, 3)))


class Transformer(nn.Module):
    """A small transformer (two encoder layers, over 20 parameter tensors)."""

    def __init__(self, d_model: int = 16, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d_model, 4)

    def forward(self, x, *, rank=0, micro=0):
        for block in self.blocks:
            x = block(x)
        return self.head(x[:, 0])


class EmbeddingBag(nn.Module):
    """An embedding (dense or sparse gradients) feeding a linear head."""

    def __init__(self, sparse: bool = False, vocab: int = 32, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, sparse=sparse)
        self.head = nn.Linear(dim, 4)

    def forward(self, x, *, rank=0, micro=0):
        return self.head(self.emb(x).sum(dim=1))


class RankBranches(nn.Module):
    """Control flow that depends on the rank or the micro-batch.

    modes:
      unused-all        `never` is used by no rank: its grad must stay None.
      unused-on-rank1   `extra` is used on even ranks only: every rank gets the average.
      used-on-odd-ranks `extra` is used on odd ranks only (rank 0 does not use it: issue 30, who decides).
      micro-flow        `extra` is used only in micro-batch 0 (pytorch/pytorch#69031).
      rank-idle         rank `idle_rank` uses no parameter at all (pytorch/pytorch#40566).
      unused-no-fuf     like unused-all, for runs without find_unused_parameters
                        (pytorch/pytorch#128949): the implementation must error or be right.
    """

    def __init__(self, mode: str = "unused-on-rank1", idle_rank: int = 1):
        super().__init__()
        self.mode, self.idle_rank = mode, idle_rank
        self.trunk = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x, *, rank=0, micro=0):
        if self.mode == "rank-idle" and rank == self.idle_rank:
            # A loss that needs a backward but reaches no parameter.
            return x[:, :4].clone().requires_grad_(True) * 1.0
        h = self.trunk(x)
        use_extra = {
            "unused-on-rank1": rank % 2 == 0,
            "used-on-odd-ranks": rank % 2 == 1,
            "micro-flow": micro == 0,
        }.get(self.mode, False)
        if use_extra:
            h = h + self.extra(x)
        if self.mode in ("rank-idle",):
            h = h + self.extra(x)
        return self.head(torch.relu(h))


class Tied(nn.Module):
    """A weight used twice in one forward (a shared layer and a transposed tie)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8, bias=False)
        self.shared = nn.Linear(8, 8)
        self.dec = nn.Linear(8, 8, bias=False)
        self.dec.weight = self.enc.weight  # tied: one parameter, two uses

    def forward(self, x, *, rank=0, micro=0):
        h = self.shared(torch.relu(self.enc(x)))
        h = self.shared(torch.relu(h))
        return self.dec(h)


class Frozen(MLP):
    """An MLP whose first layer is frozen (requires_grad=False): never reduced, never stepped."""

    def __init__(self):
        super().__init__(depth=3, width=16)
        for p in self.layers[0].parameters():
            p.requires_grad_(False)


class MixedDtype(nn.Module):
    """fp32 and fp64 parameters in one model: buckets must split by dtype."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8).double()
        self.c = nn.Linear(8, 4)

    def forward(self, x, *, rank=0, micro=0):
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h.double())).float()
        return self.c(h)


class BigParam(nn.Module):
    """One parameter (256x256 fp32, 256 KiB) larger than a tiny bucket cap, among small ones."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 256)
        self.big = nn.Linear(256, 256)
        self.out = nn.Linear(256, 4)

    def forward(self, x, *, rank=0, micro=0):
        return self.out(torch.relu(self.big(torch.relu(self.inp(x)))))


class ManyTiny(nn.Module):
    """Hundreds of tiny parameters: stresses per-parameter overhead and bucket packing."""

    def __init__(self, count: int = 256):
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(8)) for _ in range(count))
        self.head = nn.Linear(8, 4)

    def forward(self, x, *, rank=0, micro=0):
        h = x
        for i, s in enumerate(self.scales):
            # integer-valued throughout: every scale's gradient is exact
            h = torch.relu(h + s) if i % 2 else h - s
        return self.head(h)


class Buffered(nn.Module):
    """A buffer that the forward both updates and uses (like running statistics in use).

    `running` is rank-dependent at construction; the forward scales its input by
    (1 + running) and then updates `running` from the batch. If buffers are not broadcast
    from rank 0 before each forward, ranks other than 0 compute with their own running
    value and the gradients differ from the oracle's.
    """

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("running", torch.zeros(8))

    def forward(self, x, *, rank=0, micro=0):
        out = self.lin(x * (1 + self.running))
        with torch.no_grad():
            self.running.mul_(0.5).add_(x.mean(dim=0), alpha=0.5)
        return out


class BufferOrder(nn.Module):
    """Two same-shape buffers registered in a different order on odd ranks.

    Both are used and updated by forward. Matching buffers by position (a coalesced broadcast
    of `module.buffers()`) silently puts rank 0's `scale` into an odd rank's `shift`: only a
    name-aware broadcast gives every rank rank 0's values (huggingface/transformers#48162 class).
    """

    takes_rank = True  # build_model passes the rank to the constructor

    def __init__(self, rank: int = 0):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        names = ("scale", "shift") if rank % 2 == 0 else ("shift", "scale")
        for name in names:
            self.register_buffer(name, torch.zeros(8))

    def forward(self, x, *, rank=0, micro=0):
        out = self.lin(x * (1 + self.scale) + self.shift)
        with torch.no_grad():
            self.scale.mul_(0.5).add_(x.mean(dim=0), alpha=0.5)
            self.shift.add_(0.25)
        return out


class DictOut(nn.Module):
    """An MLP whose forward returns a dict holding a tensor and a list of tensors (issue 30, inputs).

    DDP walks the output for the tensors its `find_unused_parameters` graph walk starts from:
    a walk that misses a container kind sees no parameter used. The loss sums every tensor.
    """

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.aux = nn.Linear(8, 4)

    def forward(self, x, *, rank=0, micro=0):
        h = torch.relu(self.trunk(x))
        return {"out": self.head(h), "aux": [self.aux(h)]}


class CheckpointedMLP(nn.Module):
    """An MLP whose hidden segments run under activation checkpointing.

    `checkpoint`: "none" | "non-reentrant" | "reentrant" (torch.utils.checkpoint's
    `use_reentrant`); `shared=True` runs one hidden layer in two checkpointed segments, so
    with reentrant checkpointing its gradient arrives in two separate backward passes.
    Only the input layer runs outside a checkpoint.
    """

    def __init__(self, checkpoint: str = "none", shared: bool = False, width: int = 16):
        super().__init__()
        self.checkpoint, self.shared = checkpoint, shared
        self.inp = nn.Linear(8, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(1 if shared else 2))
        self.out = nn.Linear(width, 4)

    def forward(self, x, *, rank=0, micro=0):
        from torch.utils.checkpoint import checkpoint

        h = torch.relu(self.inp(x))
        # The output layer is checkpointed too: the first gradients of backward then arrive
        # inside a (reentrant) segment, not in the outer backward.
        segments = [lambda t, layer=self.hidden[0 if self.shared else k]: torch.relu(layer(t)) for k in range(2)]
        for segment in [*segments, self.out]:
            if self.checkpoint == "none":
                h = segment(h)
            else:
                h = checkpoint(segment, h, use_reentrant=self.checkpoint == "reentrant")
        return h


class InputSpec:
    """How to draw one shard of inputs for a model (shape and kind)."""

    def __init__(self, shape: tuple[int, ...], kind: str = "float", high: int = 32):
        self.shape, self.kind, self.high = shape, kind, high


BUILTIN_MODELS: dict[str, tuple[Callable[..., nn.Module], InputSpec, str]] = {
    "mlp": (MLP, InputSpec((8,)), "3-layer MLP"),
    "cnn-bn": (ConvBN, InputSpec((2, 4, 4)), "CNN with BatchNorm"),
    "transformer": (Transformer, InputSpec((4, 16)), "2-layer transformer encoder"),
    "embedding": (EmbeddingBag, InputSpec((3,), "index", 32), "embedding + linear"),
    "branches": (RankBranches, InputSpec((8,)), "rank/micro-dependent control flow"),
    "tied": (Tied, InputSpec((8,)), "tied and shared weights"),
    "frozen": (Frozen, InputSpec((8,)), "first layer frozen"),
    "mixed-dtype": (MixedDtype, InputSpec((8,)), "fp32 + fp64 parameters"),
    "big-param": (BigParam, InputSpec((8,)), "a parameter larger than the bucket cap"),
    "many-tiny": (ManyTiny, InputSpec((8,)), "256 tiny parameters"),
    "buffered": (Buffered, InputSpec((8,)), "a buffer updated and used by forward"),
    "buffer-order": (BufferOrder, InputSpec((8,)), "two buffers registered in a rank-dependent order"),
    "ckpt-mlp": (CheckpointedMLP, InputSpec((8,)), "MLP with activation-checkpointed segments"),
    "dict-out": (DictOut, InputSpec((8,)), "outputs in a dict and a list"),
}

# Realistic architectures (issue 39), one module each; their declared properties (dropout,
# buffers, unused parameters, MoE) are `conformance.models.registry`.
from conformance.models.gpt import GPT  # noqa: E402
from conformance.models.llama import Llama  # noqa: E402
from conformance.models.moe import MoEModel  # noqa: E402
from conformance.models.resnet import ResNet  # noqa: E402

BUILTIN_MODELS.update({
    "gpt": (GPT, InputSpec((8,), "index", 32), "GPT-style decoder: tied embeddings, LayerNorm, causal attention, dropout"),
    "llama": (Llama, InputSpec((8,), "index", 32), "Llama-style decoder: RMSNorm, rotary, SwiGLU, grouped-query attention"),
    "moe": (MoEModel, InputSpec((3,), "index", 32), "top-2 of 8 routed mixture of experts with capacity and an aux loss"),
    "resnet": (ResNet, InputSpec((3, 8, 8)), "ResNet-style CNN: residual blocks, BatchNorm"),
})
