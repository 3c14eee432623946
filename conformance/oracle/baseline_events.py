"""What the oracle says a correct run shows: `Expected` comparison points and a `Baseline`.

Plain data and two tensor helpers, below the oracles that fill them (`conformance.oracle.baseline`
and, for production-training features, `conformance.oracle.baseline_features`) and the contract that
reads them, so that neither oracle imports the other to share them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from conformance.spec import Scenario

Grads = dict[str, Tensor | None]


@dataclass
class Expected:
    """One comparison point. `per_rank[r]` is what rank r must hold."""

    kind: str  # "backward" | "step"
    step: int
    micro: int
    synced: bool
    per_rank: list[dict[str, Tensor | None]]
    # After a step, what each rank's buffers must be: rank 0's state at the forward, then the
    # rank's own update. Ranks other than 0 are only modelled (not None) with one micro-batch
    # per step: under no_sync, DDP skips the broadcast at the next forward.
    buffers: list[dict[str, Tensor] | None] = field(default_factory=list)

    def where(self) -> str:
        if self.kind == "joined":
            return "after join (every rank must hold the model of the last rank to run out of data)"
        if self.kind == "step":
            return f"after optimizer step {self.step}"
        sync = "synced" if self.synced else "no_sync"
        return f"after backward (step {self.step}, micro-batch {self.micro}, {sync})"


@dataclass
class Baseline:
    scenario: Scenario
    init_params: dict[str, Tensor]
    init_buffers: dict[str, Tensor]
    events: list[Expected]
    # Per-rank state after construction where a declared rule leaves ranks unsynchronized
    # (construction sync at the first forward; buffers never synchronized); None: rank 0's.
    init_params_ranks: list[dict[str, Tensor]] | None = None
    init_buffers_ranks: list[dict[str, Tensor]] | None = None
    # (rank, step, micro, cause): the first forward whose recorded RNG state is not where the rank's
    # previous forward left the stream, in a model that draws random numbers (conformance.oracle.streams)
    rng_break: tuple[int, int, int, str] | None = None
    # Re-anchored only: step -> {parameter: (the reference step R, the widest candidate step's distance
    # from it)}, for the straight-through check's accumulated envelope (conformance.oracle.trajectory);
    # None where a step cannot be replayed per candidate order.
    reach: dict[int, dict] | None = None

    def init_for(self, rank: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        params = self.init_params_ranks[rank] if self.init_params_ranks else self.init_params
        buffers = self.init_buffers_ranks[rank] if self.init_buffers_ranks else self.init_buffers
        return params, buffers


def dense(t: Tensor | None) -> Tensor | None:
    """A detached copy, sparse gradients made dense (what ranks report and comparisons read)."""
    if t is None:
        return None
    t = t.detach()
    return t.coalesce().to_dense() if t.is_sparse else t.clone()


def load_buffers(model: torch.nn.Module, values: dict[str, Tensor]) -> None:
    """Set the model's buffers to `values` in place (the oracle replays rank 0's broadcast)."""
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(values[name])
