"""Rank side of DDP scenarios with production-training features (`conformance.features`).

The loop is the plain DDP loop (`conformance.runners.ddp`: every micro-batch but a step's last
inside `no_sync()`) with what real training adds:
the wrapper's `join()` around it, autocast and a GradScaler, torch.compile, gradient
clipping, requires_grad toggles and a checkpoint round trip. It records the same events
(construction, every backward, every step) plus, under join, placeholders for the steps a
rank had no data for and a final "joined" event with the parameters every rank holds after
the join. Nothing is judged here.
"""

from __future__ import annotations

import contextlib
import io
import re
import time
import traceback

import torch

from conformance.adapters import registry
from conformance.adapters.protocol import OptimizerSpec, owned
from conformance.features import (
    Features,
    apply_requires_grad,
    autocast,
    inputs,
    model_kwargs,
    wrapping,
)
from conformance.features import optimizer as make_optimizer
from conformance.models import rng
from conformance.models.data import build_model, model_loss
from conformance.runners import build_order as orders
from conformance.spec import Expect, Scenario
from refimpl import _torch_compat

_COMPILED_PREFIX = "_orig_mod."


class _Unprefixed:
    """A wrapped model whose module went through torch.compile: names without `_orig_mod.`."""

    def __init__(self, wrapped):
        self._wrapped = wrapped

    def __getattr__(self, name):
        return getattr(self._wrapped, name)

    def __call__(self, *args, **kwargs):
        return self._wrapped(*args, **kwargs)

    @staticmethod
    def _strip(d):
        return {n.replace(_COMPILED_PREFIX, "", 1): v for n, v in d.items()}

    def full_gradients(self):
        return self._strip(self._wrapped.full_gradients())

    def full_parameters(self):
        return self._strip(self._wrapped.full_parameters())

    def full_buffers(self):
        return self._strip(self._wrapped.full_buffers())


def _wrapper(wrapped, what: str):
    """The DDP-like module behind an adapter's wrapped object (join, state_dict need it)."""
    ddp = getattr(wrapped, "ddp", None)
    if ddp is None:
        raise RuntimeError(f"this adapter's wrapped model exposes no DDP-like module (.ddp), needed for {what}")
    return ddp


def _build(scenario: Scenario, feats: Features, adapter, ctx, seed: int, taps: list | None = None, before_wrap=None):
    """The model, compiled and wrapped as the scenario says; `before_wrap(model)`: the user's steps
    between building the bare module and wrapping it (conformance.runners.build_order)."""
    model = build_model(
        scenario.model, model_kwargs(scenario, feats, oracle=False), seed=seed, rank=ctx.rank,
        dtype=scenario.dtype, device=ctx.device, exact=scenario.exact_data,
    )
    if before_wrap is not None:
        before_wrap(model)
    if feats.compile:
        # A fresh process's compile, whatever this warm rank compiled before: Dynamo's cache
        # does not guard on the wrapper (torch DDP's DDPOptimizer splits the graph at the
        # bucket boundaries of the first DDP it compiled under, and a later case reused them).
        torch.compiler.reset()
    # The RNG state each forward of the user's module starts from (not under compile: a hook there
    # would break Dynamo's graph; compile scenarios draw no random numbers in forward).
    if taps is not None and not feats.compile:
        taps.append(rng.ForwardTap(model, ctx.device))
    if feats.compile == "model":
        model = torch.compile(model, backend=feats.compile_backend)
    with wrapping(feats, ctx.device), _ddp_mode(feats):
        if "optimizer" in owned(adapter, scenario):  # protocol v2: the engine builds (and steps) its own optimizer
            spec = OptimizerSpec(scenario.optimizer, lr=feats.lr, clip=feats.clip, micro_batches=scenario.micro_batches)
            wrapped = adapter.wrap(model, ctx, scenario.options, optimizer=spec)
        else:
            wrapped = adapter.wrap(model, ctx, scenario.options)
    if feats.compile == "model":
        wrapped = _Unprefixed(wrapped)
    if feats.compile == "wrapper":
        ddp = _wrapper(wrapped, "torch.compile around the wrapper")
        wrapped.ddp = torch.compile(ddp, backend=feats.compile_backend)
    return wrapped


def _ddp_mode(feats: Features):
    """Compiled autograd: torch DDP reduces under it only in its Python reducer mode, which it reads
    at construction (torch/nn/parallel/distributed.py: `_use_python_reducer`; the C++ reducer
    refuses compiled autograd); set for the construction only, so a warm rank's later cases keep
    torch's default."""
    if feats.compile != "compiled-autograd":
        return contextlib.nullcontext()
    return _torch_compat.dynamo_python_reducer()


def _backward_mode(feats: Features):
    """The backward pass under compiled autograd (its graph compiled with the compile backend)."""
    if feats.compile != "compiled-autograd":
        return contextlib.nullcontext()
    return _torch_compat.compiled_autograd_enabled(torch.compile(backend=feats.compile_backend))


def _construct(scenario, feats, adapter, ctx, seed: int, taps=None, checkpoint: dict | None = None):
    """Model, optimizer and wrapper in the scenario's construction order; on a resume, the
    `checkpoint` loaded where its resume order says (`conformance.runners.build_order`).

    Returns the wrapper, the optimizer, and the optimizer state still to load (optimizer-late:
    after the resumed run's first backward; None otherwise).
    """
    owns = owned(adapter, scenario)
    early = orders.optimizer_first(scenario, owns)
    resume = orders.resume_order(feats) if checkpoint is not None else None
    state = checkpoint["optimizer"] if checkpoint is not None else None
    made = []

    def before_wrap(model):
        if resume == "load-wrap":
            model.load_state_dict(orders.module_state(checkpoint["model"]))
        if early:  # over the bare module's parameters: the wrapper must keep these objects
            made.append(make_optimizer(scenario, feats, orders.trainable(model)))
            if made[0] is not None and state is not None and resume != "optimizer-late":
                made[0].load_state_dict(state)

    wrapped = _build(scenario, feats, adapter, ctx, seed=seed, taps=taps, before_wrap=before_wrap)
    if checkpoint is not None and resume != "load-wrap":
        if checkpoint["engine_api"]:
            wrapped.load_checkpoint_state(checkpoint["model"])
        else:
            _wrapper(wrapped, "a checkpoint round trip").load_state_dict(checkpoint["model"])
    if early:
        optimizer = made[0]
    else:
        optimizer = wrapped.optimizer if "optimizer" in owns else make_optimizer(scenario, feats, wrapped.optimizer_parameters())
        if optimizer is not None and state is not None and resume != "optimizer-late":
            optimizer.load_state_dict(state)
    late = state if optimizer is not None and resume == "optimizer-late" else None
    return wrapped, optimizer, late


def _round_trip(scenario, feats, adapter, ctx, wrapped, optimizer, scaler, taps=None):
    """Save wrapper + optimizer (+ scaler), rebuild everything from scratch, load, go on.

    Through the engine's own checkpoint API where it has one (`Wrapped.checkpoint_state`,
    e.g. DeepSpeed's save_checkpoint, ZeroRedundancyOptimizer.consolidate_state_dict), torch
    DDP's `state_dict` (keys `module.` + the module's) otherwise. Returns the rebuilt wrapper,
    its optimizer and the optimizer state still to load (`_construct`).
    """
    if feats.state_dict:  # the sharded area's full / DCP round trip (issue #26)
        from conformance.runners.sharded_checkpoint import round_trip

        def rebuild():
            new = _build(scenario, feats, adapter, ctx, seed=scenario.seed + 1, taps=taps)
            return new, (new.optimizer if "optimizer" in owned(adapter, scenario)
                         else make_optimizer(scenario, feats, new.optimizer_parameters()))

        return (*round_trip(feats.state_dict, ctx, wrapped, optimizer, _close, rebuild), None)
    engine_api = callable(getattr(wrapped, "checkpoint_state", None))
    if engine_api:
        state = wrapped.checkpoint_state()
    else:
        ddp = _wrapper(wrapped, "a checkpoint round trip")
        state = ddp.state_dict()
        want = ["module." + k for k in ddp.module.state_dict()]
        if list(state) != want:
            raise RuntimeError(
                "state_dict keys differ from torch DDP's ('module.' + the module's keys): "
                f"got {list(state)[:4]}..., expected {want[:4]}..."
            )
        del ddp
    buf = io.BytesIO()
    torch.save({"model": state, "optimizer": optimizer.state_dict() if optimizer and not engine_api else None,
                "scaler": scaler.state_dict() if scaler else None}, buf)
    _close(wrapped)
    del wrapped, optimizer, state
    buf.seek(0)
    checkpoint = torch.load(buf, weights_only=not engine_api)
    checkpoint["engine_api"] = engine_api
    # A different seed: nothing of the first model survives except through the checkpoint.
    rebuilt = _construct(scenario, feats, adapter, ctx, scenario.seed + 1, taps, checkpoint)
    if scaler is not None:
        scaler.load_state_dict(checkpoint["scaler"])
    return rebuilt


def _module(wrapped):
    module = getattr(wrapped, "module", None)
    if module is None:
        raise RuntimeError("this adapter's wrapped model exposes no .module, needed to toggle requires_grad")
    return module


def train(scenario: Scenario, feats: Features, adapter, ctx) -> dict:
    torch.manual_seed(rng.seed_of(scenario.seed, ctx.rank))  # the stream dropout draws from (conformance.models.rng)
    record: dict = {"events": [], "error": None, "seconds": {}}
    t0 = time.perf_counter()
    taps: list = []  # the RNG state each forward of the user's module starts from (the newest model's)
    wrapped, optimizer, _ = _construct(scenario, feats, adapter, ctx, scenario.seed, taps)
    record["seconds"]["wrap"] = time.perf_counter() - t0
    record["init"] = {"parameters": wrapped.full_parameters(), "buffers": wrapped.full_buffers()}
    owns = owned(adapter, scenario)
    late = None  # an optimizer state to load after the resumed run's first backward (optimizer-late)
    backward = wrapped.backward if "backward" in owns else (lambda loss: loss.backward())
    scaler = torch.amp.GradScaler(ctx.device.type, init_scale=feats.init_scale) if feats.grad_scaler else None
    joining = contextlib.nullcontext()
    if feats.join:
        joining = _wrapper(wrapped, "join").join(
            divide_by_initial_world_size=feats.divide_by_initial_world_size,
            throw_on_early_termination=feats.throw_on_early_termination,
        )
    own_steps = feats.steps(scenario, ctx.rank)
    step = micro = fired_before = 0
    t0 = time.perf_counter()
    try:
        with joining:
            for step in range(own_steps):
                if step > 0 and step in feats.round_trips:
                    fired_before += _fired_so_far(wrapped)
                    wrapped, optimizer, late = _round_trip(scenario, feats, adapter, ctx, wrapped, optimizer, scaler, taps)
                    if "backward" in owns:  # the rebuilt engine's own backward, not the closed one's
                        backward = wrapped.backward
                if feats.freeze:
                    apply_requires_grad(_module(wrapped), feats, step)
                for micro in range(scenario.micro_batches):  # all but the last inside no_sync()
                    synced = micro == scenario.micro_batches - 1
                    x = inputs(scenario, feats, rank=ctx.rank, step=step, micro=micro, device=ctx.device)
                    before = rng.capture(ctx.device)  # where the stream stands (if no tap sees the forward)
                    if taps:
                        taps[-1].take()
                    with contextlib.nullcontext() if synced else wrapped.no_sync():
                        with autocast(feats, ctx.device):
                            loss = model_loss(wrapped, scenario.model, x, rank=ctx.rank, micro=micro)
                        with _backward_mode(feats):
                            backward(scaler.scale(loss) if scaler is not None else loss)
                    record["events"].append(
                        {"kind": "backward", "step": step, "micro": micro, "synced": synced,
                         "values": wrapped.full_gradients(),
                         "loss": loss.detach().to("cpu", copy=True),  # for --record (conformance.recording)
                         "shards": _local_shards(wrapped) if synced else None,  # sharded area (conformance/judge/shards.py)
                         "rng": taps[-1].take(before) if taps else before}  # the oracle replays this forward from it
                    )
                if late is not None:  # after the first backward, before the step that uses it
                    optimizer.load_state_dict(late)
                    late = None
                if optimizer is not None:
                    _step(feats, optimizer, scaler, wrapped, owns)
                record["events"].append(
                    {"kind": "step", "step": step, "values": wrapped.full_parameters(), "buffers": wrapped.full_buffers(),
                     "shards": _local_shards(wrapped)}
                )
    except Exception as exc:  # noqa: BLE001 - recorded; the contract fails any error the scenario does not accept
        # Recorded rather than raised, so the record (and a mutant's fired count) comes back.
        accepted = scenario.expect in (Expect.MATCH_OR_ERROR, Expect.ERROR) and re.search(scenario.error_pattern, str(exc))
        record["error"] = {"type": type(exc).__name__, "message": str(exc), "step": step, "micro": micro,
                           "traceback": traceback.format_exc(), "accepted": bool(accepted)}
    if feats.join and record["error"] is None:
        total = feats.total_steps(scenario)
        for s in range(own_steps, total):  # steps this rank had no batch for: nothing to compare
            record["events"].append({"kind": "backward", "step": s, "micro": 0, "synced": True, "values": None})
            record["events"].append({"kind": "step", "step": s, "values": None, "buffers": None})
        record["events"].append({"kind": "joined", "step": total, "values": wrapped.full_parameters(),
                                 "buffers": wrapped.full_buffers()})
    record["seconds"]["train"] = time.perf_counter() - t0
    stats = getattr(wrapped, "backward_stats", None)
    record["backward_stats"] = stats() if callable(stats) else None
    probe = getattr(wrapped, "allreduce_probe", None)  # optional (protocol): the backend's summation order
    record["allreduce_probe"] = probe() if callable(probe) else None
    if fired_before and isinstance(record["backward_stats"], dict):  # the wrapper before a round trip
        record["backward_stats"]["mutation_fired"] = record["backward_stats"].get("mutation_fired", 0) + fired_before
    _close(wrapped)
    return record


def _close(wrapped) -> None:
    """The optional `Wrapped.close()` (protocol): always called once the run is recorded."""
    close = getattr(wrapped, "close", None)
    if callable(close):
        close()


def _local_shards(wrapped) -> dict | None:
    """Each rank's own shards where a sharded adapter exposes them (optional `Wrapped.local_shards`)."""
    local = getattr(wrapped, "local_shards", None)
    return local() if callable(local) else None


def _fired_so_far(wrapped) -> int:
    stats = getattr(wrapped, "backward_stats", None)
    data = stats() if callable(stats) else None
    return data.get("mutation_fired", 0) if isinstance(data, dict) else 0


def _step(feats: Features, optimizer, scaler, wrapped, owns=frozenset()) -> None:
    """Clip, step, zero_grad: the user's way, or the engine's for what it owns (protocol v2).

    Clipping: the wrapped object's `clip_grad_norm_(max_norm)` where it has one (an engine's
    sharded-aware clip, e.g. FairScale's `OSS.clip_grad_norm`); an engine that owns the
    optimizer without one clips inside its step (it got `OptimizerSpec.clip`); otherwise
    torch's `clip_grad_norm_` over the optimizer's parameters.
    """
    if feats.clip is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        engine_clip = getattr(wrapped, "clip_grad_norm_", None)
        if callable(engine_clip):
            engine_clip(feats.clip)
        elif "optimizer" not in owns:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, feats.clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if "zero_grad" in owns:
        wrapped.zero_grad(set_to_none=True)
    else:
        optimizer.zero_grad(set_to_none=True)


def _first_difference(a: dict, b: dict) -> str | None:
    """Where two runs' records first differ bitwise (None when identical)."""
    for i, (x, y) in enumerate(zip(a["events"], b["events"], strict=False)):
        xv, yv = x.get("values") or {}, y.get("values") or {}
        for name in xv:
            s, t = xv[name], yv.get(name)
            if (s is None) != (t is None) or s is not None and not (
                torch.equal(s, t) or torch.equal(s.nan_to_num(), t.nan_to_num())
            ):
                return f"event {i} ({x['kind']} of step {x['step']}), {name}"
    if len(a["events"]) != len(b["events"]):
        return f"{len(a['events'])} vs {len(b['events'])} events"
    return None


def run(payload, ctx) -> dict:
    scenario, adapter_spec = payload
    feats = Features.of(scenario)
    adapter = registry.load(adapter_spec)
    first = train(scenario, feats, adapter, ctx)
    if feats.repeat > 1:
        again = [train(scenario, feats, adapter, ctx) for _ in range(feats.repeat - 1)]
        diffs = [_first_difference(first, other) for other in again]
        first["determinism"] = {"runs": feats.repeat, "identical": not any(diffs),
                                "first_difference": next((d for d in diffs if d), None)}
        # A mutant's bug may take effect in any of the runs (a determinism bug shows as the runs
        # differing), so the case's fired count is every run's, not the first run's alone.
        stats = first.get("backward_stats")
        if isinstance(stats, dict):
            stats["mutation_fired"] = stats.get("mutation_fired", 0) + sum(
                (o.get("backward_stats") or {}).get("mutation_fired", 0) for o in again)
    return first


def check_determinism(scenario: Scenario, adapter_spec: str, values: dict) -> dict | None:
    """Coordinator side: the determinism verdict per rank (for the report), or None.

    Raises only when runs differed and the adapter declares `deterministic = True`.
    """
    per_rank = {r: v.get("determinism") for r, v in values.items() if isinstance(v, dict) and v.get("determinism")}
    if not per_rank:
        return None
    differing = {r: d["first_difference"] for r, d in per_rank.items() if not d["identical"]}
    if differing and getattr(registry.load(adapter_spec), "deterministic", False):
        from conformance.judge.compare import ConformanceError

        r, where = next(iter(differing.items()))
        raise ConformanceError(
            f"[{scenario.id}] adapter {adapter_spec} declares deterministic = True, but two runs of the same "
            f"scenario differ bitwise on rank {r} at {where}"
        )
    return {"identical": not differing, "per_rank": per_rank}
