"""Which production-training scenarios an adapter can run, decided when cases are planned.

The production loop (`conformance.runners.ddp_features`) drives every adapter, protocol v2
included (an engine that owns the optimizer, backward or zero_grad gets them called its way).
What it cannot do for an adapter is known before anything runs, from the adapter's own
declarations (`owns`, `semantics`, `ddp_module`): such a scenario is skipped here with the
reason, never run into an exception that would read as the engine's failure.

Engine-specific limits (a feature the engine's documentation says it does not offer, or does
its own way) are the adapter's `unavailable(scenario)`; see `production_features` in
`conformance.adapters.engines` for the built-in engines' table.

Generic limits, for any adapter:
- a GradScaler scales the loss before `loss.backward()`: an engine that owns backward does its
  own loss scaling, so GradScaler scenarios do not apply to it;
- `torch.compile` around the wrapper, `join()` and the default checkpoint round trip need the
  wrapped object's DDP-like module (`Wrapped.ddp`, torch DDP's `join`/`state_dict`): an adapter
  says it has one with `ddp_module = True` (DDP-like adapters do), or offers the engine's own
  checkpoint API (`Wrapped.checkpoint_state` / `load_checkpoint_state`, `checkpoint_api = True`);
- the orders of `conformance.runners.build_order`: an engine that owns the optimizer has no user
  optimizer to build before wrapping; a resume that loads the module's state before wrapping, or
  the optimizer's after a backward, needs torch DDP's state dicts (`ddp_module`);
- declared semantics the production oracle cannot model yet: buffers never synchronized, or
  synchronized at construction only, on a model with buffers.
"""

from __future__ import annotations

import functools

from conformance.adapters.protocol import owned
from conformance.features import Features
from conformance.oracle.buffers import rule as buffer_rule
from conformance.semantics import Buffers, Precision, declared


@functools.cache
def has_buffers(scenario) -> bool:
    from conformance.models.data import build_model

    model = build_model(scenario.model, scenario.kwargs(), seed=0, rank=0, dtype="float32", device="cpu")
    return bool(list(model.buffers()))


def ddp_module(adapter) -> bool:
    """Whether the adapter's wrapped object exposes a torch-DDP-like module as `.ddp`."""
    declared_flag = getattr(adapter, "ddp_module", None)
    if declared_flag is not None:
        return bool(declared_flag)
    from conformance.adapters.ddp_like import DDPLikeAdapter

    return isinstance(adapter, DDPLikeAdapter)


def unsupported(adapter, scenario) -> str | None:
    """Why the production loop or its oracle cannot run `scenario` for `adapter` (None: it can)."""
    owns = owned(adapter, scenario)
    if "optimizer" in owns and scenario.kwargs().get("build_order", "wrap-first") != "wrap-first":
        return "the engine builds its own optimizer (protocol v2): there is no user optimizer to build before wrapping"
    if not getattr(scenario, "features", None):
        return None
    feats = Features.of(scenario)
    if feats.resume_order not in ("", "wrap-load") and (not ddp_module(adapter) or getattr(adapter, "checkpoint_api", False)):
        # torch-zero is DDP-like but restores model and optimizer together through its own API
        # (ZeroRedundancyOptimizer's consolidated state): the order is the engine's, one call after building.
        return (f"resume order {feats.resume_order}: loading the module's state before wrapping, or the optimizer's "
                "apart from the model's, needs torch DDP's state_dict (adapter.ddp_module), not an engine's own "
                "checkpoint API (adapter.checkpoint_api: one call restores both, after building)")
    if feats.grad_scaler and "backward" in owns:
        return "the engine owns backward (protocol v2), so the loss it is given cannot be scaled by a GradScaler"
    if feats.compile == "wrapper" and not ddp_module(adapter):
        return "torch.compile around the wrapper needs a DDP-like module (adapter.ddp_module)"
    if feats.save_load_at is not None and not feats.state_dict and not (ddp_module(adapter) or getattr(adapter, "checkpoint_api", False)):
        return ("a checkpoint round trip needs torch DDP's state_dict (adapter.ddp_module) or the engine's own "
                "checkpoint API (adapter.checkpoint_api: Wrapped.checkpoint_state/load_checkpoint_state)")
    if feats.join and not ddp_module(adapter):
        return "join() is torch DDP's context manager on the wrapper (adapter.ddp_module)"
    sem = declared(adapter, scenario)
    if sem.precision != Precision.PARAMS and scenario.dtype in ("float16", "bfloat16"):
        return (f"the production-training oracle does not model the declared precision '{sem.precision.value}' "
                "(fp32 master weights) yet")
    if buffer_rule(scenario, sem) == Buffers.CONSTRUCTION_ONLY and has_buffers(scenario):
        return (f"the production-training oracle does not model the buffer rule '{Buffers.CONSTRUCTION_ONLY.value}' "
                "yet (declared, or a broadcast after backward turned off by broadcast_buffers=False)")
    return None
