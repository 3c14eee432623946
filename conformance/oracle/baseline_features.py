"""The oracle for scenarios with production-training features (`conformance.features`).

Same principle as `conformance.oracle.baseline`: one process replays every rank's shard with the
same kernels the rank uses (one `autograd.grad` per shard, summed across ranks last), then
applies what the feature does to the averaged gradients:

- join: at each step only the ranks that still have a batch contribute; the average is
  `sum_active grad / divisor` with the divisor the wrapper documents (initial world size,
  or the number of active ranks). Ranks out of data expect nothing until the join ends;
  then every rank must hold the oracle's final model (the last joiner's).
  With `throw_on_early_termination`, the ranks train together until the first one runs out,
  then every rank must raise.
- autocast / GradScaler: each shard's forward runs under the same autocast; the loss is
  scaled by the same scale; the recorded gradients are the scaled averages; `scaler.step`
  and `update` run on the oracle's own scaler (an overflow on any rank skips the step on all).
- clip: `clip_grad_norm_` on the averaged gradients (after unscaling, with a scaler), or the
  engine's own clipping where it declares one (`Semantics.clipping`, e.g. DeepSpeed's). In the
  sharded area the global norm is summed over shards in the engine's order: the clipped step's
  parameters are judged against the bound derived for that (`conformance.oracle.clip_bound`).
- freeze: the same requires_grad schedule; frozen parameters have no gradient.
- a sharded engine's mixed-precision policy: each rank's forward and backward in param_dtype from
  the cast masters, its gradient cast to reduce_dtype (or, declared, its no_sync() sum kept in
  param_dtype until the reduction), reduced, cast back to the masters' dtype, as the plain oracle
  does (`conformance.oracle.baseline_mixed`); clipping and a state-dict round trip then act on
  fp32 gradients and masters, as they do in the engine.
- checkpointed models run without checkpointing; compile and checkpoint round trips do not
  change the expected values at all (training straight through, eagerly, is the reference).
"""

from __future__ import annotations

import torch

from conformance.features import (
    Features,
    apply_requires_grad,
    autocast,
    inputs,
    model_kwargs,
    optimizer,
)
from conformance.models.data import build_model, model_loss
from conformance.oracle import baseline_mixed
from conformance.oracle import buffers as buffer_rule
from conformance.oracle.accumulation import add_grad, reduced_per_micro_batch
from conformance.oracle.anchor import load_params
from conformance.oracle.baseline_events import Baseline, Expected, dense, load_buffers
from conformance.oracle.clip_bound import ClipBound
from conformance.oracle.clip_bound import applies as clip_applies
from conformance.oracle.envelope import reduce, reference, rule_of
from conformance.oracle.streams import Streams
from conformance.semantics import (
    TORCH_DDP,
    Accumulation,
    Buffers,
    ConstructionSync,
    MidAccumulation,
    MixedAccumulation,
    Semantics,
    Unused,
)
from conformance.spec import Scenario


def compute(scenario: Scenario, semantics: Semantics = TORCH_DDP, anchor=None) -> Baseline:
    """The oracle under the declared `semantics`; re-anchored on the engine's state with an
    `anchor` (`conformance.oracle.anchor`), straight through without. Cross-rank sums are envelopes
    under the rule `conformance.oracle.baseline.rule_of` gives (`conformance.oracle.envelope`).

    Modelled: unused parameters as zeros, construction sync at the first forward or at the first
    optimizer step (step 0 forwards each rank's own parameters, only rank 0 participates), buffers
    by `conformance.oracle.buffers` (rank 0's broadcast before a step's first forward only, or after
    backward; never synchronized, as with `broadcast_buffers=False`: each rank's own from
    construction on), a lossy bound (judged by the contract), micro-batch accumulation
    (every micro-batch but a step's last inside `no_sync()`: each rank's local sum after each,
    added in autograd's order; a declared mean or per-micro-batch reduction as in
    `conformance.oracle.baseline`). Buffers synchronized at construction only are refused at plan time
    (`conformance.adapters.feature_support`) and here; so are several micro-batches with `join()`.
    """
    return _FeatureReplay(scenario, semantics or TORCH_DDP, anchor).run()


class _FeatureReplay:
    """One scenario with features replayed rank by rank, in the phases of a training step:

        1. construction      the model (with the features' arguments), optimizer, scaler, the
                             declared lossy communication and clipping; refusals of what is not
                             modelled; what each rank holds until a lazy construction sync
        2. local gradients   every active rank's micro-batches under autocast and the scaler:
                             its shares and its local sums inside no_sync()
        3. synced reduce     the active ranks' sums reduced by the declared rule and divisor
        4. step              clipping (torch's, the engine's declared one, or the bound for
                             another order of the norm), the scaler, the optimizer
    """

    # -- 1. construction --------------------------------------------------------------------
    def __init__(self, scenario: Scenario, semantics: Semantics, anchor):
        self.scenario, self.semantics, self.anchor = scenario, semantics, anchor
        self.feats = feats = Features.of(scenario)
        self.W = W = scenario.world_size
        torch.manual_seed(scenario.seed)
        self.model = model = build_model(
            scenario.model, model_kwargs(scenario, feats, oracle=True), seed=scenario.seed, rank=0,
            dtype=scenario.dtype, device=scenario.device, exact=scenario.exact_data,
        )
        self.buffer_rule = buffer_rule.rule(scenario, semantics)
        self._refuse_unmodelled()
        M = self.M = scenario.micro_batches
        self.mean = semantics.accumulation == Accumulation.MEAN and M > 1
        self.reduced_each = semantics.mid_accumulation == MidAccumulation.REDUCED and M > 1
        # A mixed-precision policy's no_sync() sum declared kept in param_dtype (cast at the reduction).
        self.low_sum = baseline_mixed.applies(scenario) and semantics.mixed_accumulation == MixedAccumulation.PARAM_DTYPE
        self.opt = optimizer(scenario, feats, [p for p in model.parameters() if p.requires_grad])
        device_type = torch.device(scenario.device).type
        self.scaler = torch.amp.GradScaler(device_type, init_scale=feats.init_scale) if feats.grad_scaler else None
        self.baseline = Baseline(scenario, self._state(), self._buffers(), [])
        self.streams = Streams(scenario, anchor)  # each rank's dropout stream, replayed (conformance.oracle.streams)
        lazy = semantics.construction_sync == ConstructionSync.FIRST_FORWARD
        self.first_step = semantics.construction_sync == ConstructionSync.FIRST_STEP
        self.own_params = None
        if lazy or self.first_step:  # each rank holds its own until then
            own = [build_model(scenario.model, model_kwargs(scenario, feats, oracle=True), seed=scenario.seed, rank=r,
                               dtype=scenario.dtype, device=scenario.device, exact=scenario.exact_data) for r in range(W)]
            self.own_params = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in own]
            self.baseline.init_params_ranks = self.own_params
            if lazy:
                self.baseline.init_buffers_ranks = [{n: b.detach().clone() for n, b in m.named_buffers()} for m in own]
        # Buffers never synchronized: each rank forwards from its own, as it built them (None: every
        # rank starts a step from rank 0's, broadcast before the step's first forward or after backward).
        self.rank_buffers = None
        if self.buffer_rule == Buffers.NEVER:
            self.rank_buffers = [_own_buffers(scenario, feats, r) for r in range(W)]
            self.baseline.init_buffers_ranks = list(self.rank_buffers)

        self.rule = rule_of(scenario, semantics)
        # Declared lossy communication (PowerSGD): simulated over the ranks' gradients, with its state.
        self.comm = None
        if semantics.communication is not None:
            self.comm = semantics.communication.simulator(
                scenario, [(n, p) for n, p in model.named_parameters() if p.requires_grad],
                anchor.allreduce_probe if anchor is not None else None)
        opt = self.opt
        self.clip = ClipBound(feats.clip, opt) if opt is not None and clip_applies(scenario, semantics, feats) else None

    def _refuse_unmodelled(self) -> None:
        scenario, feats, model = self.scenario, self.feats, self.model
        if self.buffer_rule == Buffers.CONSTRUCTION_ONLY and list(model.buffers()):
            raise ValueError(f"scenario {scenario.id}: the production-training oracle does not model the buffer rule "
                             f"{self.buffer_rule.value!r} (the model has buffers)")
        if feats.join and list(model.buffers()):
            raise ValueError(f"scenario {scenario.id}: join scenarios use buffer-free models (the buffer source moves)")
        if scenario.micro_batches > 1 and feats.join:
            raise ValueError(f"scenario {scenario.id}: several micro-batches per step are modelled without join() only")

    def _state(self) -> dict:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def _buffers(self) -> dict:
        return {n: b.detach().clone() for n, b in self.model.named_buffers()}

    def run(self) -> Baseline:
        feats, W = self.feats, self.W
        for step in range(feats.total_steps(self.scenario)):
            self._reanchor(step)
            apply_requires_grad(self.model, feats, step)
            self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            self.params = [p for _, p in self.named]
            active = feats.active(step) if feats.join else list(range(W))
            divisor = feats.divisor(W, step)
            healing = self.first_step and step == 0  # declared: step 0 runs on each rank's own parameters
            local, shares, inside, after_forward, rank0_buffers = self._local_gradients(step, active, healing)
            total = self._synced_reduce(active, divisor, healing, local, shares, rank0_buffers)
            if self.semantics.buffers == Buffers.AFTER_BACKWARD:  # rank 0's buffers broadcast after the synced backward
                after_forward = {r: rank0_buffers for r in after_forward}
            per_rank = [total if r in active else None for r in range(W)]
            for micro, snapshot in enumerate(inside):
                self.baseline.events.append(Expected("backward", step, micro, False, snapshot))
            self.baseline.events.append(Expected("backward", step, self.M - 1, True, per_rank))
            bounds = self._step(step, total)
            self._step_event(step, active, after_forward, bounds)
        if feats.join and not feats.throw_on_early_termination:
            self.baseline.events.append(Expected("joined", feats.total_steps(self.scenario), 0, True, [self._state()] * W))
        self.baseline.rng_break = self.streams.broken
        return self.baseline

    def _reanchor(self, step: int) -> None:
        """Re-anchored: the step starts from the engine's own recorded parameters and buffers."""
        anchor = self.anchor
        if anchor is not None and anchor.params_before(step) is not None:  # the engine's own state
            load_params(self.model, anchor.params_before(step))
            anchored_buffers = anchor.buffers_before(step)
            if anchored_buffers is not None:
                load_buffers(self.model, anchored_buffers[0])
                if self.rank_buffers is not None:  # each rank's own, as the engine recorded them
                    self.rank_buffers = list(anchored_buffers)

    # -- 2. local gradients -----------------------------------------------------------------
    def _local_gradients(self, step: int, active: list[int], healing: bool):
        """Every active rank's micro-batches: (its local sums by name, the shares per micro-batch,
        each rank's sum inside no_sync(), the buffers each rank's forwards left, rank 0's)."""
        scenario, feats, model, M, W = self.scenario, self.feats, self.model, self.M, self.W
        named, params = self.named, self.params
        start_buffers = self._buffers()
        rank0_buffers, after_forward = start_buffers, {}
        local: dict[str, list] = {n: [] for n, _ in named}  # every active rank's own gradient
        shares: list[list[dict]] = [[] for _ in range(M)]  # per micro-batch, every active rank's own gradient
        inside: list[list] = [[None] * W for _ in range(M - 1)]  # each rank's local sum inside no_sync()
        for rank in active:
            # A step's first forward starts from rank 0's buffers (broadcast), the later micro-batches
            # from the ones this rank's own forwards left (the broadcast skipped after a no_sync()
            # forward: conformance.oracle.buffers); never synchronized: the rank's own throughout.
            load_buffers(model, start_buffers if self.rank_buffers is None else self.rank_buffers[rank])
            if healing:
                load_params(model, self.own_params[rank])
            accumulated = {n: None for n, _ in named}
            for micro in range(M):
                x = inputs(scenario, feats, rank=rank, step=step, micro=micro, device=scenario.device)
                fwd, fwd_params = baseline_mixed.compute_module(model, params, scenario)  # policy: cast masters
                with autocast(feats, scenario.device), self.streams.forward(rank, step, micro):
                    loss = model_loss(fwd, scenario.model, x, rank=rank, micro=micro)
                if self.scaler is not None:
                    loss = self.scaler.scale(loss)
                grads = (torch.autograd.grad(loss, fwd_params, allow_unused=True) if loss.requires_grad
                         else [None] * len(params))
                if not self.low_sum:  # a policy's gradient enters the reduction in reduce_dtype
                    grads = [baseline_mixed.to_reduce_dtype(dense(g), scenario) for g in grads]
                share = {name: dense(g) / M if self.mean and g is not None else dense(g)
                         for (name, _), g in zip(named, grads, strict=True)}
                shares[micro].append(share)
                accumulated = {n: add_grad(accumulated[n], share[n]) for n in accumulated}
                if micro < M - 1 and not self.reduced_each:  # declared REDUCED: nothing per rank to read
                    inside[micro][rank] = dict(accumulated)
            for name, _ in named:
                local[name].append(accumulated[name])
            after_forward[rank] = self._buffers()
            if self.rank_buffers is not None:
                self.rank_buffers[rank] = after_forward[rank]
            if rank == active[0]:
                rank0_buffers = after_forward[rank]
        return local, shares, inside, after_forward, rank0_buffers

    # -- 3. synced reduce -------------------------------------------------------------------
    def _synced_reduce(self, active: list[int], divisor, healing: bool, local: dict, shares: list,
                       rank0_buffers: dict) -> dict:
        """The synced gradient every active rank holds, by the declared reduction and divisor."""
        named, rule = self.named, self.rule
        load_buffers(self.model, rank0_buffers)
        if healing:  # the primary's (rank 0's) state everywhere at the first optimizer step; only it participates
            load_params(self.model, self.own_params[0])
            total = {n: reduce(local[n][:1], 1, rule) for n, _ in named}
        elif self.comm is not None:
            total = self.comm.reduce([{n: local[n][r] for n, _ in named} for r in range(len(active))])
        elif self.reduced_each:
            total = reduced_per_micro_batch(shares, len(active), rule)
        else:
            if self.low_sum:  # declared: the param_dtype sum is cast to reduce_dtype only now
                local = {n: [baseline_mixed.to_reduce_dtype(g, self.scenario) for g in local[n]] for n, _ in named}
            total = {n: reduce(local[n], divisor, rule) for n, _ in named}
        if baseline_mixed.applies(self.scenario):  # the reduced gradient cast back to the masters' dtype
            total = {n: baseline_mixed.to_master_dtype(total[n], p.dtype) for n, p in named}
        if self.semantics.unused == Unused.ZEROS:
            total = {n: torch.zeros_like(p) if total[n] is None else total[n] for n, p in named}
        return total

    # -- 4. step ----------------------------------------------------------------------------
    def _step(self, step: int, total: dict):
        """Clip, unscale and step on the synced (or the engine's judged) gradients; the bounds of
        a clipped step whose norm the engine sums in another order, if any."""
        opt, scaler, clip, feats, params = self.opt, self.scaler, self.clip, self.feats, self.params
        if opt is None:
            return None
        # Re-anchored: the optimizer (and scaler) step on the engine's own (judged) gradients.
        stepped = self.anchor.grads(step) if self.anchor is not None else None
        for name, p in self.named:
            g = reference(total[name]) if stepped is None else dense(stepped.get(name))
            p.grad = None if g is None else g.clone()
        if feats.clip is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            if self.semantics.clipping is not None and clip is None:  # declared: the engine's own arithmetic, replayed
                self.semantics.clipping.apply([torch.zeros_like(p) if p.grad is None else p.grad for p in params],
                                              feats.clip, self.W)
            else:
                if clip is not None:  # conformance.oracle.clip_bound: another engine's order of the norm
                    clip.before_clip(params)
                norm = torch.nn.utils.clip_grad_norm_(params, feats.clip)
                if clip is not None:
                    clip.check_norm(float(norm))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        bounds = clip.after_step(self.named) if clip is not None else None
        opt.zero_grad(set_to_none=True)
        return bounds

    def _step_event(self, step: int, active: list[int], after_forward: dict, bounds) -> None:
        params_now = self._state()
        if bounds:  # the clipped step within the bound derived for a reordered global norm
            params_now = self.clip.envelopes(params_now, bounds)
        self.baseline.events.append(Expected(
            "step", step, 0, True, [params_now if r in active else None for r in range(self.W)],
            buffers=[after_forward.get(r) for r in range(self.W)],
        ))


def _own_buffers(scenario: Scenario, feats: Features, rank: int) -> dict:
    """Rank `rank`'s buffers as it built them (before any synchronization)."""
    m = build_model(scenario.model, model_kwargs(scenario, feats, oracle=True), seed=scenario.seed, rank=rank,
                    dtype=scenario.dtype, device=scenario.device, exact=scenario.exact_data)
    return {n: b.detach().clone() for n, b in m.named_buffers()}
