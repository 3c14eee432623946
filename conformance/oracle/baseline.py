"""The single-process oracle for the data-parallel contract (DESIGN.md, "The contract").

For a scenario with world size W it replays, in one process and from the same seeds, what
every rank computes on its own shard, and derives what a correct implementation must show:

- after construction: rank 0's parameters and buffers on every rank;
- after a backward inside `no_sync()`: each rank's *local* accumulated gradient;
- after a synced backward: `(1/W) * sum_r sum_k grad L_{r,k}` on every rank, with
  `None` for a parameter that no rank used;
- after each optimizer step: the parameters the same optimizer produces from those
  gradients, and rank 0's buffers.

Buffers follow DDP's rule (`conformance.oracle.buffers`): rank 0 broadcasts before each forward
that follows a forward outside `no_sync()` (a step's first), so that forward starts every shard
from rank 0's buffers and the step's later micro-batches from the rank's own; with
`broadcast_buffers=False` every rank keeps its own from construction on. An adapter that declares other rules
(conformance.semantics: buffers never synced or broadcast after backward, construction sync at
the first forward, unused parameters as zeros, micro-batches averaged or reduced one by one,
fp32 master weights, a dynamic loss scaler that skips overflow steps) gets an oracle that
models exactly those rules.

Each rank's gradient is computed with the same kernels and shapes the rank itself uses
(one `autograd.grad` per shard) and kept apart: the cross-rank sum is an `Envelope`
(`conformance.oracle.envelope`) of every summation order a backend may use, per element, so for world
sizes 1 and 2 the result is bitwise what a correct implementation produces and at 3-4 ranks
it is bitwise one of the orders. Low-precision sums get the bound derived from the ranks'
contributions. Which rule applies is the scenario's tolerance (or the adapter's declared one).

Two oracles come out of the same loop (see `conformance.oracle.anchor`, "re-anchored steps"):
`compute_anchored` starts every step from the engine's own recorded state, so each step is
judged on its own; `compute` trains straight through from the seeds (computed once per
scenario), for the second, reported check.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

import torch
from torch import Tensor

from conformance.models.data import build_model, forward_loss, make_inputs, make_optimizer
from conformance.oracle import baseline_features, baseline_mixed, trajectory
from conformance.oracle import buffers as buffer_rule
from conformance.oracle.accumulation import (
    add_grad,
    reduce_scattered_per_micro_batch,
    reduced_per_micro_batch,
)
from conformance.oracle.anchor import Anchor, load_params
from conformance.oracle.baseline_events import Baseline, Expected, Grads, dense, load_buffers
from conformance.oracle.envelope import reduce, reference, rule_of
from conformance.oracle.streams import Streams, isolated
from conformance.semantics import (
    TORCH_DDP,
    Accumulation,
    Buffers,
    ConstructionSync,
    MidAccumulation,
    MixedAccumulation,
    Precision,
    Semantics,
    Unused,
)
from conformance.spec import EXACT, Scenario, Tolerance

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


def average(local: list[Grads], world_size: int, rule: Tolerance = EXACT) -> dict:
    """(1/W) * sum over ranks as the engine may compute it under `rule`: a tensor where the
    result is order-free, else an `Envelope`; None if no rank used the parameter."""
    return {name: reduce([grads[name] for grads in local], world_size, rule) for name in local[0]}


@functools.lru_cache(maxsize=256)
def compute(scenario: Scenario, semantics: Semantics = TORCH_DDP) -> Baseline:
    """The oracle for `scenario` under the declared `semantics`, computed once per process."""
    with _single_thread(), isolated(scenario.device):
        if scenario.features:  # join, AMP, compile ...: conformance.oracle.baseline_features
            return baseline_features.compute(scenario, semantics)
        return _compute(scenario, semantics)


def compute_anchored(scenario: Scenario, semantics: Semantics, records: dict[int, dict]) -> Baseline:
    """The oracle re-anchored on the engine's own state at every step (`conformance.oracle.anchor`)."""
    anchor = Anchor(records, scenario.world_size)
    with _single_thread(), isolated(scenario.device):
        if scenario.features:
            return baseline_features.compute(scenario, semantics, anchor=anchor)
        return _compute(scenario, semantics, anchor)


def oracles(scenario: Scenario, semantics: Semantics, records: dict[int, dict]) -> tuple[Baseline, Baseline]:
    """(re-anchored, straight-through) oracles for one case. The straight-through one is only
    computed where its check has a band of its own; elsewhere bitwise re-anchored steps imply it
    and the re-anchored oracle stands in."""
    anchored = compute_anchored(scenario, semantics, records)
    rule = rule_of(scenario, semantics)
    needed = rule.straight_through is not None or rule.kind in ("band", "norm")
    return anchored, compute(scenario, semantics) if needed else anchored


def _own_state(scenario: Scenario, rank: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Rank `rank`'s parameters and buffers as it built them (before any synchronization)."""
    m = build_model(
        scenario.model, scenario.kwargs(), seed=scenario.seed, rank=rank,
        dtype=scenario.dtype, device=scenario.device, exact=scenario.exact_data,
    )
    return ({n: p.detach().clone() for n, p in m.named_parameters()},
            {n: b.detach().clone() for n, b in m.named_buffers()})


def _compute(scenario: Scenario, sem: Semantics, anchor: Anchor | None = None) -> Baseline:
    return _Replay(scenario, sem, anchor).run()


class _Replay:
    """One scenario replayed rank by rank in this process, in the phases every engine runs:

        1. construction      the model from the seeds, the optimizer (on fp32 masters if declared),
                             declared lossy communication and loss scaling; what each rank holds
                             after construction (rank 0's state, or its own until a later sync)
        2. local gradients   per micro-batch, every rank's own backward on its shard, from the
                             buffers the declared rule gives it, kept apart per rank
        3. synced reduce     at the last micro-batch, the ranks' gradients reduced by the
                             declared tree (`_synced_average`); inside no_sync(), each rank's
                             local sum is what it shows
        4. step              the optimizer on the reduced (or, re-anchored, the engine's own
                             judged) gradients; what carries into the next step's gradients

    Each phase appends the comparison points it defines to `self.baseline.events`.
    """

    # -- 1. construction --------------------------------------------------------------------
    def __init__(self, scenario: Scenario, sem: Semantics, anchor: Anchor | None):
        self.scenario, self.sem, self.anchor = scenario, sem, anchor
        self.W = W = scenario.world_size
        self.rule = rule_of(scenario, sem)
        self.buffer_rule = buffer_rule.rule(scenario, sem)  # the declared one, with broadcast_buffers
        torch.manual_seed(scenario.seed)
        self.model = build_model(
            scenario.model, scenario.kwargs(), seed=scenario.seed, rank=0,
            dtype=scenario.dtype, device=scenario.device, exact=scenario.exact_data,
        )
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        self.optimizer = make_optimizer(scenario.optimizer, self.params)
        # Declared fp32 master weights: the optimizer steps fp32 copies, the parameters get them cast back.
        self.master = None
        if sem.precision in (Precision.FP32_MASTER, Precision.FP32_MASTER_FP32_ACCUMULATION) and scenario.dtype in (
                "bfloat16", "float16"):
            self.master = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
            self.optimizer = make_optimizer(scenario.optimizer, self.master)
        # Declared lossy communication (PowerSGD): simulated over the ranks' gradients, with its state.
        probed = anchor.allreduce_probe if anchor is not None else None  # the backend's order (3+ ranks)
        self.comm = sem.communication.simulator(scenario, self.named, probed) if sem.communication is not None else None
        # Declared dynamic loss scaling inside the engine's backward (DeepSpeed fp16): replayed step by step.
        self.scaler = sem.loss_scaler.start() if sem.loss_scaler is not None else None
        self.baseline = Baseline(scenario, self._state(), self._buffers(), [])
        self.streams = Streams(scenario, anchor)  # each rank's dropout stream, replayed (conformance.oracle.streams)

        # What each rank holds after construction: rank 0's state, unless a declared rule says the
        # sync happens later (first forward) or never (buffers).
        lazy = sem.construction_sync == ConstructionSync.FIRST_FORWARD
        self.first_step = sem.construction_sync == ConstructionSync.FIRST_STEP
        own_needed = lazy or self.first_step or self.buffer_rule == Buffers.NEVER
        self.own = [_own_state(scenario, r) for r in range(W)] if own_needed else None
        if lazy or self.first_step:
            self.baseline.init_params_ranks = [self.own[r][0] for r in range(W)]
        self.rank_buffers = [self._buffers()] * W
        if self.own is not None and (lazy or self.buffer_rule == Buffers.NEVER):
            self.rank_buffers = [self.own[r][1] for r in range(W)]
            self.baseline.init_buffers_ranks = list(self.rank_buffers)
            if self.buffer_rule in (Buffers.CONSTRUCTION_ONLY, Buffers.AFTER_BACKWARD):
                self.rank_buffers = [self.rank_buffers[0]] * W  # the lazy construction sync copies rank 0's
        self.mean = sem.accumulation == Accumulation.MEAN
        self.reduced_each = sem.mid_accumulation == MidAccumulation.REDUCED
        self.rs_only = scenario.options.accumulate_reduce_scattered  # HSDP: the tree of conformance.oracle.envelope.staged_reduce
        self.low_sum = baseline_mixed.applies(scenario) and sem.mixed_accumulation == MixedAccumulation.PARAM_DTYPE
        # After zero_grad(set_to_none=False) a gradient is a zero tensor, not None: carried into the
        # next step (an unused parameter then keeps zeros, as torch DDP leaves it unchanged).
        self.carried: dict[str, Tensor | None] = {n: None for n, _ in self.named}
        # Re-anchored at 3+ ranks: each step also replayed per candidate order (conformance.oracle.trajectory).
        replayable = self.rule.kind == "summation-order" and self.optimizer is not None and not (
            self.master or self.scaler or self.comm)
        self.baseline.reach = {} if anchor is not None and replayable else None

    def _state(self) -> dict[str, Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def _buffers(self) -> dict[str, Tensor]:
        return {n: b.detach().clone() for n, b in self.model.named_buffers()}

    def run(self) -> Baseline:
        for step in range(self.scenario.steps):
            self._reanchor(step)
            avg, skipped, after_forward = self._backwards(step)
            self._step(step, avg, skipped)
            self._step_event(step)
        self.baseline.rng_break = self.streams.broken
        return self.baseline

    def _reanchor(self, step: int) -> None:
        """Re-anchored: the step starts from the engine's own recorded parameters and buffers."""
        anchor = self.anchor
        if anchor is not None and anchor.params_before(step) is not None:
            load_params(self.model, anchor.params_before(step))
            self.rank_buffers = list(anchor.buffers_before(step) or self.rank_buffers)
            load_buffers(self.model, self.rank_buffers[0])

    # -- 2. local gradients -----------------------------------------------------------------
    def _backwards(self, step: int) -> tuple[dict | None, bool, list]:
        """Every micro-batch of a step: (the synced gradient, whether the step is skipped, the
        buffers each rank's last forward left)."""
        W, scenario = self.W, self.scenario
        local: list[Grads] = [dict(self.carried) for _ in range(W)]
        micro_shares: list[list[Grads]] = []  # per micro-batch, every rank's own gradient (REDUCED)
        avg, skipped, after_forward = None, False, []
        for micro in range(scenario.micro_batches):
            micro_shares.append([{} for _ in range(W)])
            synced = micro == scenario.micro_batches - 1
            after_forward = [self._rank_backward(step, micro, rank, local, micro_shares[-1]) for rank in range(W)]
            self._buffers_after(after_forward, synced)
            if self.first_step and step == 0:
                load_params(self.model, self.own[0][0])  # rank 0's state everywhere at the first optimizer step
            skipped = synced and self.scaler is not None and self.scaler.overflowed(local)
            if skipped:  # declared: the step is skipped, its (inf/NaN) gradients discarded and not judged
                avg = {n: None for n, _ in self.named}
                self.baseline.events.append(Expected("backward", step, micro, True, [None] * W))
            elif synced:
                avg = self._synced_reduce(step, micro, local, micro_shares)
            else:
                self._local_event(step, micro, local)
        return avg, skipped, after_forward

    def _rank_backward(self, step: int, micro: int, rank: int, local: list[Grads], shares: list[Grads]) -> dict:
        """One rank's forward and backward on its shard; its gradients added into `local[rank]`.
        Returns the buffers its forward left."""
        scenario, sem, model = self.scenario, self.sem, self.model
        # torch DDP: a forward that follows one outside no_sync() starts from rank 0's buffers
        # (broadcast); any other forward from the rank's own (conformance.oracle.buffers).
        broadcast = self.buffer_rule == Buffers.BEFORE_FORWARD and buffer_rule.broadcasts(micro)
        start = self.rank_buffers[0] if broadcast else self.rank_buffers[rank]
        load_buffers(model, start)
        if self.first_step and step == 0:  # step 0 runs on each rank's own parameters
            load_params(model, self.own[rank][0])
        (x,) = make_inputs(
            scenario.model, seed=scenario.seed, rank=rank, step=step, micro=micro,
            size=scenario.shard_size(rank), dtype=scenario.dtype, device=scenario.device,
        )
        # A mixed-precision policy: forward/backward in param_dtype from cast masters (baseline_mixed).
        fwd, fwd_params = baseline_mixed.compute_module(model, self.params, scenario)
        with self.streams.forward(rank, step, micro):
            loss = forward_loss(fwd, scenario, x, rank=rank, step=step, micro=micro, device=scenario.device)
        if self.scaler is not None:
            if self.mean:  # declared with the scaler: engine.backward divides the loss by the count, then scales it
                loss = loss / scenario.micro_batches
            loss = loss * self.scaler.scale  # the engine's scale_loss, in the loss's dtype
        if loss.requires_grad and self.params:
            grads = torch.autograd.grad(loss, fwd_params, allow_unused=True)
        else:
            grads = [None] * len(self.params)
        for (name, _), g in zip(self.named, grads, strict=True):
            # Declared: a no_sync() sum kept in param_dtype is cast to reduce_dtype only at the reduction.
            g = dense(g) if self.low_sum else baseline_mixed.to_reduce_dtype(dense(g), scenario)
            if self.mean and g is not None and self.scaler is None:
                g = g / scenario.micro_batches
            if g is not None and sem.precision == Precision.FP32_MASTER_FP32_ACCUMULATION:
                g = g.float()  # declared: added into the rank's fp32 accumulator
            local[rank][name] = add_grad(local[rank][name], g)
            shares[rank][name] = g
        return self._buffers()

    def _buffers_after(self, after_forward: list, synced: bool) -> None:
        """The buffers each rank starts its next forward from, by the declared buffer rule."""
        W = self.W
        if self.buffer_rule == Buffers.AFTER_BACKWARD and synced:
            self.rank_buffers = [after_forward[0]] * W  # rank 0's buffers broadcast after backward
        else:  # each rank's own (before forward: rank 0's wins at the next forward that broadcasts)
            self.rank_buffers = after_forward
        load_buffers(self.model, self.rank_buffers[0])

    def _local_event(self, step: int, micro: int, local: list[Grads]) -> None:
        """Inside no_sync(): each rank shows its own accumulated gradient."""
        snapshot = [{n: dense(g) for n, g in grads.items()} for grads in local]
        if self.reduced_each or self.rs_only:  # reduced per micro-batch: no local gradient per rank to read
            snapshot = [None] * self.W
        self.baseline.events.append(Expected("backward", step, micro, False, snapshot))

    # -- 3. synced reduce -------------------------------------------------------------------
    def _synced_reduce(self, step: int, micro: int, local: list[Grads], micro_shares: list[list[Grads]]) -> dict:
        """The synced backward's gradient on every rank, by the declared reduction."""
        scenario, sem, W = self.scenario, self.sem, self.W
        if sem.precision == Precision.FP32_MASTER_FP32_ACCUMULATION:  # declared: the fp32 sums are cast to
            half = getattr(torch, scenario.dtype)  # the parameters' dtype to be reduced (communication_data_type)
            local = [{n: None if g is None else g.to(half) for n, g in grads.items()} for grads in local]
        if self.first_step and step == 0:
            avg = average(local[:1], 1, self.rule)  # only rank 0 participates; the others heal
        else:
            avg = _synced_average(scenario, W, self.rule, self.comm, local, micro_shares,
                                  reduced_each=self.reduced_each, rs_only=self.rs_only, low_sum=self.low_sum)
        if baseline_mixed.applies(scenario):  # the reduced gradient cast back to the masters' dtype
            avg = {n: baseline_mixed.to_master_dtype(avg[n], p.dtype) for n, p in self.named}
        if sem.unused == Unused.ZEROS:
            avg = {n: torch.zeros_like(p) if avg[n] is None else avg[n] for n, p in self.named}
        self.baseline.events.append(Expected("backward", step, micro, True, [avg] * W))
        return avg

    # -- 4. step ----------------------------------------------------------------------------
    def _step(self, step: int, avg: dict | None, skipped: bool) -> None:
        """The optimizer step, and what the next step's gradients start from."""
        scenario, optimizer, scaler, named = self.scenario, self.optimizer, self.scaler, self.named
        if optimizer is not None and scaler is not None and skipped:
            scaler.update(overflow=True)
            self.carried = {n: None for n, _ in named}
        elif optimizer is not None:
            # Re-anchored: the optimizer steps on the engine's own (judged) gradients.
            stepped = self.anchor.grads(step) if self.anchor is not None else None
            if self.baseline.reach is not None and trajectory.replayable(avg, optimizer):
                self.baseline.reach[step] = trajectory.reach(optimizer, named, avg)
            elif self.baseline.reach is not None:
                self.baseline.reach = None  # not replayable per order: the band judges straight through
            for i, (name, p) in enumerate(named):
                g = reference(avg[name]) if stepped is None else dense(stepped.get(name))
                target = p if self.master is None else self.master[i]
                target.grad = None if g is None else g.clone().to(target.dtype)
                if scaler is not None and target.grad is not None:
                    target.grad.mul_(1.0 / scaler.scale)  # unscale_and_clip_grads, on the fp32 masters
            optimizer.step()
            if scaler is not None:
                scaler.update(overflow=False)
            if self.master is not None:  # the half-precision parameters are the masters cast back
                with torch.no_grad():
                    for p, m in zip(self.params, self.master, strict=True):
                        p.copy_(m.to(p.dtype))
            set_to_none = scenario.zero_grad != "alternate" or step % 2 == 0
            self.carried = {n: None if (set_to_none or avg[n] is None) else torch.zeros_like(p) for n, p in named}
            optimizer.zero_grad(set_to_none=True)
        elif scenario.optimizer == "none":
            # Issue 30: no optimizer, so no zero_grad: the next synced backward adds to this one
            # (a parameter no rank uses next keeps this gradient). Scenarios without an optimizer
            # use one micro-batch per step: what a rank shows inside no_sync() on top of an earlier
            # synced gradient differs between engines (p.grad or a local buffer), not modelled.
            self.carried = {n: avg[n] for n, _ in named}

    def _step_event(self, step: int) -> None:
        """After the step: every rank's parameters, and its buffers by the declared rule."""
        W = self.W
        per_rank = list(self.rank_buffers)  # what each rank's last forward left (or rank 0's, broadcast after backward)
        self.baseline.events.append(Expected("step", step, 0, True, [self._state()] * W, buffers=per_rank))


def _synced_average(scenario: Scenario, W: int, rule: Tolerance, comm, local: list[Grads],
                    micro_shares: list[list[Grads]], *, reduced_each: bool, rs_only: bool, low_sum: bool) -> dict:
    """A synced backward's reduced gradient, by the declared tree: a simulated lossy communication
    (PowerSGD); every micro-batch reduced, then added (ZeRO-2/3); HSDP's per-micro-batch
    reduce-scatter; or the ranks' local sums averaged, cast to ``reduce_dtype`` first where the
    declared local sum is kept in ``param_dtype`` (``low_sum``)."""
    if comm is not None:
        return comm.reduce(local)
    if reduced_each:
        return reduced_per_micro_batch(micro_shares, W, rule)
    if rs_only:
        return reduce_scattered_per_micro_batch(micro_shares, W, scenario.options.hsdp_replicas, rule)
    if low_sum:
        local = [{n: baseline_mixed.to_reduce_dtype(g, scenario) for n, g in grads.items()} for grads in local]
    return average(local, W, rule)
