"""The single-process oracle for the data-parallel contract (DESIGN.md, "The contract").

For a scenario with world size W it replays, in one process and from the same seeds, what
every rank computes on its own shard, and derives what a correct implementation must show:

- after construction: rank 0's parameters and buffers on every rank;
- after a backward inside `no_sync()`: each rank's *local* accumulated gradient;
- after a synced backward: `(1/W) * sum_r sum_k grad L_{r,k}` on every rank, with
  `None` for a parameter that no rank used;
- after each optimizer step: the parameters the same optimizer produces from those
  gradients, and rank 0's buffers.

Buffers follow DDP's rule (rank 0 broadcasts before each forward): every shard is forwarded
from rank 0's buffers, and only rank 0's update is kept.

Each rank's gradient is computed with the same kernels and shapes the rank itself uses
(one `autograd.grad` per shard) and summed across ranks last, so for world sizes 1 and 2
the result is bitwise what a correct implementation produces.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from conformance.fixtures.data import build_model, loss_fn, make_inputs, make_optimizer
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


_THREADS_LOCK = threading.Lock()  # torch's thread count is process-global


@contextmanager
def _single_thread():
    """Compute as the ranks do (one intra-op thread), so kernels reduce in the same order."""
    with _THREADS_LOCK:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def _dense(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    t = t.detach()
    return t.coalesce().to_dense() if t.is_sparse else t.clone()


def _add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def average(local: list[Grads], world_size: int) -> Grads:
    """(1/W) * sum over ranks, each rank's share divided first (as DDP does), None if unused by all."""
    out: Grads = {}
    for name in local[0]:
        total = None
        for grads in local:
            g = grads[name]
            total = _add(total, None if g is None else g / world_size)
        out[name] = total  # ranks that did not use the parameter contribute zeros
    return out


@functools.lru_cache(maxsize=256)
def compute(scenario: Scenario) -> Baseline:
    """The oracle for `scenario`, computed once per process and reused for every adapter."""
    with _single_thread():
        return _compute(scenario)


def _compute(scenario: Scenario) -> Baseline:
    W = scenario.world_size
    torch.manual_seed(scenario.seed)
    model = build_model(
        scenario.model, scenario.kwargs(), seed=scenario.seed, rank=0,
        dtype=scenario.dtype, device=scenario.device, exact=scenario.exact_data,
    )
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    optimizer = make_optimizer(scenario.optimizer, params)
    state = lambda: {n: p.detach().clone() for n, p in model.named_parameters()}  # noqa: E731
    buffers = lambda: {n: b.detach().clone() for n, b in model.named_buffers()}  # noqa: E731
    baseline = Baseline(scenario, state(), buffers(), [])

    for step in range(scenario.steps):
        local: list[Grads] = [{n: None for n, _ in named} for _ in range(W)]
        for micro in range(scenario.micro_batches):
            synced = micro == scenario.micro_batches - 1
            start_buffers = buffers()
            rank0_buffers = start_buffers
            after_forward = []
            for rank in range(W):
                _load_buffers(model, start_buffers)  # every rank forwards from rank 0's buffers
                (x,) = make_inputs(
                    scenario.model, seed=scenario.seed, rank=rank, step=step, micro=micro,
                    size=scenario.shard_size(rank), dtype=scenario.dtype, device=scenario.device,
                )
                loss = loss_fn(model(x, rank=rank, micro=micro))
                if loss.requires_grad and params:
                    grads = torch.autograd.grad(loss, params, allow_unused=True)
                else:
                    grads = [None] * len(params)
                for (name, _), g in zip(named, grads, strict=True):
                    local[rank][name] = _add(local[rank][name], _dense(g))
                after_forward.append(buffers())
                if rank == 0:
                    rank0_buffers = after_forward[0]
            _load_buffers(model, rank0_buffers)  # rank 0's update wins at the next forward
            if synced:
                avg = average(local, W)
                baseline.events.append(Expected("backward", step, micro, True, [avg] * W))
            else:
                snapshot = [{n: _dense(g) for n, g in grads.items()} for grads in local]
                baseline.events.append(Expected("backward", step, micro, False, snapshot))
        if optimizer is not None:
            for name, p in named:
                g = avg[name]
                p.grad = None if g is None else g.clone()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        per_rank = after_forward if scenario.micro_batches == 1 else [buffers()] + [None] * (W - 1)
        baseline.events.append(Expected("step", step, 0, True, [state()] * W, buffers=per_rank))
    return baseline


def _load_buffers(model: torch.nn.Module, values: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(values[name])
