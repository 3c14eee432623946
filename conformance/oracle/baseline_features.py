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
from conformance.models.data import build_model, loss_fn
from conformance.oracle.accumulation import add_grad, reduced_per_micro_batch
from conformance.oracle.anchor import load_params
from conformance.oracle.baseline_events import Baseline, Expected, dense, load_buffers
from conformance.oracle.clip_bound import ClipBound
from conformance.oracle.clip_bound import applies as clip_applies
from conformance.oracle.envelope import reduce, reference, rule_of
from conformance.semantics import (
    TORCH_DDP,
    Accumulation,
    Buffers,
    ConstructionSync,
    MidAccumulation,
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
    broadcast after backward, a lossy bound (judged by the contract), micro-batch accumulation
    (every micro-batch but a step's last inside `no_sync()`: each rank's local sum after each,
    added in autograd's order; a declared mean or per-micro-batch reduction as in
    `conformance.oracle.baseline`). Buffers never synchronized are refused at plan time
    (`conformance.adapters.feature_support`) and here; so are several micro-batches with `join()` or
    buffers (when the broadcast is skipped inside `no_sync()` is not modelled here).
    """
    semantics = semantics or TORCH_DDP
    feats = Features.of(scenario)
    W = scenario.world_size
    torch.manual_seed(scenario.seed)
    model = build_model(
        scenario.model, model_kwargs(scenario, feats, oracle=True), seed=scenario.seed, rank=0,
        dtype=scenario.dtype, device=scenario.device, exact=scenario.exact_data,
    )
    if semantics.buffers in (Buffers.NEVER, Buffers.CONSTRUCTION_ONLY) and list(model.buffers()):
        raise ValueError(f"scenario {scenario.id}: the production-training oracle does not model the buffer rule "
                         f"{semantics.buffers.value!r} (the model has buffers)")
    if feats.join and list(model.buffers()):
        raise ValueError(f"scenario {scenario.id}: join scenarios use buffer-free models (the buffer source moves)")
    M = scenario.micro_batches
    if M > 1 and (feats.join or list(model.buffers())):
        raise ValueError(f"scenario {scenario.id}: several micro-batches per step are modelled for buffer-free "
                         "models without join() only")
    mean = semantics.accumulation == Accumulation.MEAN and M > 1
    reduced_each = semantics.mid_accumulation == MidAccumulation.REDUCED and M > 1
    opt = optimizer(scenario, feats, [p for p in model.parameters() if p.requires_grad])
    device_type = torch.device(scenario.device).type
    scaler = torch.amp.GradScaler(device_type, init_scale=feats.init_scale) if feats.grad_scaler else None
    state = lambda: {n: p.detach().clone() for n, p in model.named_parameters()}  # noqa: E731
    buffers = lambda: {n: b.detach().clone() for n, b in model.named_buffers()}  # noqa: E731
    baseline = Baseline(scenario, state(), buffers(), [])
    lazy = semantics.construction_sync == ConstructionSync.FIRST_FORWARD
    first_step = semantics.construction_sync == ConstructionSync.FIRST_STEP
    own_params = None
    if lazy or first_step:  # each rank holds its own until then
        own = [build_model(scenario.model, model_kwargs(scenario, feats, oracle=True), seed=scenario.seed, rank=r,
                           dtype=scenario.dtype, device=scenario.device, exact=scenario.exact_data) for r in range(W)]
        own_params = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in own]
        baseline.init_params_ranks = own_params
        if lazy:
            baseline.init_buffers_ranks = [{n: b.detach().clone() for n, b in m.named_buffers()} for m in own]

    rule = rule_of(scenario, semantics)
    # Declared lossy communication (PowerSGD): simulated over the ranks' gradients, with its state.
    comm = None
    if semantics.communication is not None:
        comm = semantics.communication.simulator(scenario, [(n, p) for n, p in model.named_parameters() if p.requires_grad],
                                                 anchor.allreduce_probe if anchor is not None else None)
    clip = ClipBound(feats.clip, opt) if opt is not None and clip_applies(scenario, semantics, feats) else None
    for step in range(feats.total_steps(scenario)):
        bounds = None
        if anchor is not None and anchor.params_before(step) is not None:  # the engine's own state
            load_params(model, anchor.params_before(step))
            anchored_buffers = anchor.buffers_before(step)
            if anchored_buffers is not None:
                load_buffers(model, anchored_buffers[0])
        apply_requires_grad(model, feats, step)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        active = feats.active(step) if feats.join else list(range(W))
        divisor = feats.divisor(W, step)
        start_buffers = buffers()
        rank0_buffers, after_forward = start_buffers, {}
        local: dict[str, list] = {n: [] for n, _ in named}  # every active rank's own gradient
        healing = first_step and step == 0  # declared: step 0 runs on each rank's own parameters
        shares: list[list[dict]] = [[] for _ in range(M)]  # per micro-batch, every active rank's own gradient
        inside: list[list] = [[None] * W for _ in range(M - 1)]  # each rank's local sum inside no_sync()
        for rank in active:
            load_buffers(model, start_buffers)
            if healing:
                load_params(model, own_params[rank])
            accumulated = {n: None for n, _ in named}
            for micro in range(M):
                x = inputs(scenario, feats, rank=rank, step=step, micro=micro, device=scenario.device)
                with autocast(feats, scenario.device):
                    loss = loss_fn(model(x, rank=rank, micro=micro))
                if scaler is not None:
                    loss = scaler.scale(loss)
                grads = torch.autograd.grad(loss, params, allow_unused=True) if loss.requires_grad else [None] * len(params)
                share = {name: dense(g) / M if mean and g is not None else dense(g)
                         for (name, _), g in zip(named, grads, strict=True)}
                shares[micro].append(share)
                accumulated = {n: add_grad(accumulated[n], share[n]) for n in accumulated}
                if micro < M - 1 and not reduced_each:  # declared REDUCED: nothing per rank to read
                    inside[micro][rank] = dict(accumulated)
            for name, _ in named:
                local[name].append(accumulated[name])
            after_forward[rank] = buffers()
            if rank == active[0]:
                rank0_buffers = after_forward[rank]
        load_buffers(model, rank0_buffers)
        if healing:  # the primary's (rank 0's) state everywhere at the first optimizer step; only it participates
            load_params(model, own_params[0])
            total = {n: reduce(local[n][:1], 1, rule) for n, _ in named}
        elif comm is not None:
            total = comm.reduce([{n: local[n][r] for n, _ in named} for r in range(len(active))])
        elif reduced_each:
            total = reduced_per_micro_batch(shares, len(active), rule)
        else:
            total = {n: reduce(local[n], divisor, rule) for n, _ in named}
        if semantics.unused == Unused.ZEROS:
            total = {n: torch.zeros_like(p) if total[n] is None else total[n] for n, p in named}
        if semantics.buffers == Buffers.AFTER_BACKWARD:  # rank 0's buffers broadcast after the synced backward
            after_forward = {r: rank0_buffers for r in after_forward}
        per_rank = [total if r in active else None for r in range(W)]
        for micro, snapshot in enumerate(inside):
            baseline.events.append(Expected("backward", step, micro, False, snapshot))
        baseline.events.append(Expected("backward", step, M - 1, True, per_rank))
        if opt is not None:
            # Re-anchored: the optimizer (and scaler) step on the engine's own (judged) gradients.
            stepped = anchor.grads(step) if anchor is not None else None
            for name, p in named:
                g = reference(total[name]) if stepped is None else dense(stepped.get(name))
                p.grad = None if g is None else g.clone()
            if feats.clip is not None:
                if scaler is not None:
                    scaler.unscale_(opt)
                if semantics.clipping is not None and clip is None:  # declared: the engine's own arithmetic, replayed
                    semantics.clipping.apply([torch.zeros_like(p) if p.grad is None else p.grad for p in params], feats.clip, W)
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
            bounds = clip.after_step(named) if clip is not None else None
            opt.zero_grad(set_to_none=True)
        params_now = state()
        if bounds:  # the clipped step within the bound derived for a reordered global norm
            params_now = clip.envelopes(params_now, bounds)
        baseline.events.append(Expected(
            "step", step, 0, True, [params_now if r in active else None for r in range(W)],
            buffers=[after_forward.get(r) for r in range(W)],
        ))
    if feats.join and not feats.throw_on_early_termination:
        baseline.events.append(Expected("joined", feats.total_steps(scenario), 0, True, [state()] * W))
    return baseline
