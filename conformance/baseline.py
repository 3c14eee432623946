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
from rank 0's buffers, and only rank 0's update is kept. An adapter that declares other rules
(conformance.semantics: buffers never synced or broadcast after backward, construction sync at
the first forward, unused parameters as zeros, micro-batches averaged) gets an oracle that
models exactly those rules.

Each rank's gradient is computed with the same kernels and shapes the rank itself uses
(one `autograd.grad` per shard) and summed across ranks last, so for world sizes 1 and 2
the result is bitwise what a correct implementation produces.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

import torch
from torch import Tensor

from conformance import baseline_features
from conformance.baseline_events import Baseline, Expected, Grads, dense, load_buffers
from conformance.models.data import build_model, loss_fn, make_inputs, make_optimizer
from conformance.semantics import (
    TORCH_DDP,
    Accumulation,
    Buffers,
    ConstructionSync,
    Semantics,
    Unused,
)
from conformance.spec import Scenario

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
def compute(scenario: Scenario, semantics: Semantics = TORCH_DDP) -> Baseline:
    """The oracle for `scenario` under the declared `semantics`, computed once per process."""
    with _single_thread():
        if scenario.features:  # join, AMP, compile ...: conformance.baseline_features
            return baseline_features.compute(scenario, semantics)
        return _compute(scenario, semantics)


def _own_state(scenario: Scenario, rank: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Rank `rank`'s parameters and buffers as it built them (before any synchronization)."""
    m = build_model(
        scenario.model, scenario.kwargs(), seed=scenario.seed, rank=rank,
        dtype=scenario.dtype, device=scenario.device, exact=scenario.exact_data,
    )
    return ({n: p.detach().clone() for n, p in m.named_parameters()},
            {n: b.detach().clone() for n, b in m.named_buffers()})


def _compute(scenario: Scenario, sem: Semantics) -> Baseline:
    W = scenario.world_size
    torch.manual_seed(scenario.seed)
    model = build_model(
        scenario.model, scenario.kwargs(), seed=scenario.seed, rank=0,
        dtype=scenario.dtype, device=scenario.device, exact=scenario.exact_data,
    )
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    optimizer = make_optimizer(scenario.optimizer, params)
    # Declared lossy communication (PowerSGD): simulated over the ranks' gradients, with its state.
    comm = sem.communication.simulator(scenario, named) if sem.communication is not None else None
    state = lambda: {n: p.detach().clone() for n, p in model.named_parameters()}  # noqa: E731
    buffers = lambda: {n: b.detach().clone() for n, b in model.named_buffers()}  # noqa: E731
    baseline = Baseline(scenario, state(), buffers(), [])

    # What each rank holds after construction: rank 0's state, unless a declared rule says the
    # sync happens later (first forward) or never (buffers).
    lazy = sem.construction_sync == ConstructionSync.FIRST_FORWARD
    own = [_own_state(scenario, r) for r in range(W)] if (lazy or sem.buffers == Buffers.NEVER) else None
    if lazy:
        baseline.init_params_ranks = [own[r][0] for r in range(W)]
    rank_buffers = [buffers()] * W
    if own is not None and (lazy or sem.buffers == Buffers.NEVER):
        rank_buffers = [own[r][1] for r in range(W)]
        baseline.init_buffers_ranks = list(rank_buffers)
        if sem.buffers in (Buffers.CONSTRUCTION_ONLY, Buffers.AFTER_BACKWARD):
            rank_buffers = [rank_buffers[0]] * W  # the lazy construction sync copies rank 0's
    mean = sem.accumulation == Accumulation.MEAN
    # After zero_grad(set_to_none=False) a gradient is a zero tensor, not None: carried into the
    # next step (an unused parameter then keeps zeros, as torch DDP leaves it unchanged).
    carried: dict[str, Tensor | None] = {n: None for n, _ in named}

    for step in range(scenario.steps):
        local: list[Grads] = [dict(carried) for _ in range(W)]
        for micro in range(scenario.micro_batches):
            synced = micro == scenario.micro_batches - 1
            after_forward = []
            for rank in range(W):
                # torch DDP: every rank forwards from rank 0's buffers; otherwise its own.
                start = rank_buffers[0] if sem.buffers == Buffers.BEFORE_FORWARD else rank_buffers[rank]
                load_buffers(model, start)
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
                    g = dense(g)
                    if mean and g is not None:
                        g = g / scenario.micro_batches
                    local[rank][name] = _add(local[rank][name], g)
                after_forward.append(buffers())
            if sem.buffers == Buffers.BEFORE_FORWARD:
                rank_buffers = [after_forward[0]] * W  # rank 0's update wins at the next forward
            elif sem.buffers == Buffers.AFTER_BACKWARD and synced:
                rank_buffers = [after_forward[0]] * W  # rank 0's buffers broadcast after backward
            else:
                rank_buffers = after_forward
            load_buffers(model, rank_buffers[0])
            if synced:
                avg = comm.reduce(local) if comm is not None else average(local, W)
                if sem.unused == Unused.ZEROS:
                    avg = {n: torch.zeros_like(p) if avg[n] is None else avg[n] for n, p in named}
                baseline.events.append(Expected("backward", step, micro, True, [avg] * W))
            else:
                snapshot = [{n: dense(g) for n, g in grads.items()} for grads in local]
                baseline.events.append(Expected("backward", step, micro, False, snapshot))
        if optimizer is not None:
            for name, p in named:
                g = avg[name]
                p.grad = None if g is None else g.clone()
            optimizer.step()
            set_to_none = scenario.zero_grad != "alternate" or step % 2 == 0
            carried = {n: None if (set_to_none or avg[n] is None) else torch.zeros_like(p) for n, p in named}
            optimizer.zero_grad(set_to_none=True)
        if sem.buffers == Buffers.BEFORE_FORWARD:
            # Ranks other than 0 are modelled with one micro-batch per step only: under
            # no_sync, torch DDP skips the broadcast at the next forward.
            per_rank = after_forward if scenario.micro_batches == 1 else [buffers()] + [None] * (W - 1)
        else:
            per_rank = list(rank_buffers)
        baseline.events.append(Expected("step", step, 0, True, [state()] * W, buffers=per_rank))
    return baseline
