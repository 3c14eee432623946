"""The optional parts of the adapter protocols: each hook with its default, each parameter added
to a protocol call after the first version, and what a scenario needs of them.

[Note: protocols evolve without breaking adapters]
A protocol grows (`module_kwargs` on `data_parallel`, `optimizer=` on `wrap`, `owns_for`,
`allreduce_probe` ...). An adapter written against an earlier version must keep passing every
scenario it could always run, and a scenario that needs a newer part must not be run against it
and counted as the engine's `raised` failure (a TypeError about an unexpected keyword is the
adapter's age, not the engine's bug). So every optional part is declared here once:

- a **hook** (`ADAPTER_HOOKS`, `WRAPPED_HOOKS`): an attribute or method the suite reads where it
  exists, with the default it assumes where it does not; `hook(obj, name)` reads it. The
  protocol types (`conformance.adapters.protocol.AdapterHooks`, `WrappedHooks`) list the same
  names with the same defaults, and a test keeps the two in step;
- a **parameter** (`PARAMETERS`): a keyword a protocol call gained, detected on the adapter's
  signature (`offers`); a scenario that needs it (`Parameter.needed`) is skipped at plan time
  where the adapter lacks it, with the reason and the one-line change to make (`missing_part`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# name -> (default, what it is): read with `hook(adapter, name)`.
ADAPTER_HOOKS: dict[str, tuple[Any, str]] = {
    "owns": (frozenset(), "what the engine takes over from the user's loop: optimizer, backward, zero_grad (v2)"),
    "owns_for": (None, "owns_for(scenario) -> frozenset: `owns` decided per scenario (v2)"),
    "semantics": (None, "declared deviations from torch DDP (conformance.semantics.Semantics); None: torch DDP's"),
    "semantics_for": (None, "semantics_for(scenario) -> Semantics: `semantics` decided per scenario"),
    "unavailable": (None, "unavailable(scenario) -> str | None: a reason to skip a scenario that cannot run here"),
    "ddp_module": (None, "Wrapped.ddp is torch-DDP-like (state_dict, join, compile); None: judged by the adapter's class"),
    "checkpoint_api": (False, "the checkpoint round trip goes through Wrapped.checkpoint_state()/load_checkpoint_state()"),
    "deterministic": (False, "declared bitwise run-to-run determinism (the determinism scenarios check it)"),
    "chunk_sizes": (None, "chunk_sizes(rows, replicas) -> sizes: how a data_parallel adapter splits a batch"),
    "devices": (None, "devices(scenario) -> list: a data_parallel adapter's devices; None: one CPU per replica"),
    "cls": (None, "the engine class a DDP-like adapter wraps (the report reads its version)"),
}
WRAPPED_HOOKS: dict[str, tuple[Any, str]] = {
    "zero_grad": (None, "zero_grad(set_to_none=True): the engine's own (owns zero_grad, or zero_grad='engine')"),
    "backward": (None, "backward(loss): the engine's own backward (owns backward)"),
    "optimizer": (None, "the optimizer the engine built (owns optimizer)"),
    "clip_grad_norm_": (None, "clip_grad_norm_(max): the engine's own clipping"),
    "checkpoint_state": (None, "checkpoint_state() -> state: everything to restore (checkpoint_api)"),
    "load_checkpoint_state": (None, "load_checkpoint_state(state) on a fresh wrap (checkpoint_api)"),
    "allreduce_probe": (None, "allreduce_probe() -> probes: the backend's summation order (3+ ranks, simulated rules)"),
    "local_shards": (None, "local_shards() -> this rank's own shards (sharded adapters)"),
    "backward_stats": (None, "backward_stats() -> dict: the last backward's bucket timeline (the HTML draws it)"),
    "close": (None, "close(): called once after the run is recorded"),
    "ddp": (None, "the torch-DDP-like module (ddp_module adapters)"),
}
_ALL = {"adapter": ADAPTER_HOOKS, "wrapped": WRAPPED_HOOKS}


def hook(obj, name: str, owner: str = "adapter"):
    """`obj.name` where `obj` defines it, else the hook's declared default (KeyError: not a declared hook)."""
    default = _ALL[owner][name][0]
    return getattr(obj, name, default)


@dataclass(frozen=True)
class Parameter:
    """A keyword a protocol call gained after the call's first version."""

    areas: tuple[str, ...]
    method: str  # the adapter's method that takes it
    name: str
    since: str
    change: str  # the one-line change that makes an older adapter take it
    needed: Callable[[Any, Any], bool]  # (adapter, scenario) -> does this scenario pass it?

    def offered_by(self, adapter) -> bool:
        """The adapter's method takes the keyword (by name, or through **kwargs); unknown signatures pass."""
        method = getattr(adapter, self.method, None)
        if method is None:
            return True  # a missing method is the adapter's own error, reported where it is called
        try:
            params = inspect.signature(method).parameters
        except (TypeError, ValueError):  # a C function without a signature: nothing to check
            return True
        return self.name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _model_takes_kwargs(adapter, scenario) -> bool:
    from conformance.models.data_parallel import DP_MODELS

    spec = DP_MODELS.get(scenario.model)
    return spec is not None and spec.kwargs is not None


def _owns_optimizer(adapter, scenario) -> bool:
    per_scenario = hook(adapter, "owns_for")  # as protocol.owned reads it (no import: protocol imports this module)
    return "optimizer" in ((per_scenario(scenario) if callable(per_scenario) else hook(adapter, "owns")) or ())


PARAMETERS = (
    Parameter(("data_parallel",), "data_parallel", "module_kwargs", "the data_parallel protocol's keyword arguments (#30)",
              "add `module_kwargs=None` to data_parallel() and hand it to the module as keyword arguments, "
              "as torch.nn.parallel.data_parallel does", _model_takes_kwargs),
    Parameter(("ddp", "sharded"), "wrap", "optimizer", "protocol v2 (an engine that owns the optimizer)",
              "add `optimizer=None` to wrap() and build the engine's optimizer with optimizer.build(params)",
              _owns_optimizer),
)


def missing_part(adapter, scenario) -> str:
    """Why `scenario` cannot run on `adapter` written to an earlier protocol ("" when nothing is missing)."""
    for p in PARAMETERS:
        if scenario.area in p.areas and p.needed(adapter, scenario) and not p.offered_by(adapter):
            return (f"written to an earlier protocol: {p.method}() has no `{p.name}` parameter ({p.since}), "
                    f"which this scenario passes; to run it: {p.change}")
    return ""
