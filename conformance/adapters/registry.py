"""Finding adapters: by built-in name, by the `gradparity.adapters` entry-point group, by
import path `pkg.module:factory`, or `ddp-class=pkg.module:Class` for any DDP-like class.

An adapter is named by a *spec string* everywhere (CLI, scenarios' node ids, the task sent to
ranks); each process loads the adapter object from it, so nothing unpicklable travels.
"""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import entry_points

from conformance import areas

DDP_CLASS_PREFIX = "ddp-class="

# name -> "module:factory"; every built-in, whatever its area (each area's entry,
# `conformance/areas/<area>.py`, names its own), in the areas' order.
BUILTINS: dict[str, str] = {name: ref for entry in areas.ENTRIES for name, ref in entry.adapters.items()}

# Third-party engines (conformance/adapters/engines/): built in, but run only when named, since
# they need their engine installed (`gradparity[engines]`) and take longer.
ENGINE_ADAPTERS: dict[str, str] = {
    "torch-zero": "conformance.adapters.engines.torch_zero:torch_zero",
    "torch-replicate": "conformance.adapters.engines.torch_replicate:torch_replicate",
    "torch-ddp-powersgd": "conformance.adapters.engines.powersgd:torch_ddp_powersgd",
    "pfn-ddp": "conformance.adapters.engines.pfn:pfn_ddp",
    "deepspeed-zero0": "conformance.adapters.engines.deepspeed_stage0:deepspeed_zero0",
    "deepspeed-zero1": "conformance.adapters.engines.deepspeed:deepspeed_zero1",
    "deepspeed-zero1-fp32acc": "conformance.adapters.engines.deepspeed_bf16_optimizer:deepspeed_zero1_fp32acc",
    "deepspeed-zero2": "conformance.adapters.engines.deepspeed:deepspeed_zero2",
    "deepspeed-zero3": "conformance.adapters.engines.deepspeed:deepspeed_zero3",
    "deepspeed-zero3-sharded": "conformance.adapters.engines.deepspeed_sharded:deepspeed_zero3_sharded",
    "fairscale-sdp": "conformance.adapters.engines.fairscale_sdp:fairscale_sdp",
    "torchft-ddp": "conformance.adapters.engines.torchft:torchft_ddp",
    "torchft-ddp-async": "conformance.adapters.engines.torchft:torchft_ddp_async",
}
BUILTINS.update(ENGINE_ADAPTERS)

# What `gradparity run` tests when no --adapter is given.
DEFAULT_ADAPTERS: tuple[str, ...] = tuple(n for n in BUILTINS if n not in ENGINE_ADAPTERS)


class AdapterError(ValueError):
    """A bad adapter reference: the message is one line that says what to do."""


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group="gradparity.adapters")}


def known_adapters() -> dict[str, str]:
    return {**_entry_points(), **BUILTINS}


def _import(ref: str, what: str):
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise AdapterError(f"{what} {ref!r} is not of the form pkg.module:name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AdapterError(f"cannot import {module_name!r} for {what} {ref!r}: {exc} (is it installed / on PYTHONPATH?)") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AdapterError(f"module {module_name!r} has no attribute {attr!r} (from {what} {ref!r})") from None


def _build(factory, spec: str):
    """Call an adapter factory; what it raises becomes one line that says what to do (an engine the
    factory imports but that is not installed is the usual case), not a traceback with exit 1."""
    try:
        return factory()
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        raise AdapterError(
            f"adapter {spec!r} needs {missing!r}, which cannot be imported ({exc}); install the engine it adapts "
            "in this environment, or pick another adapter (`gradparity list`)"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - a user's factory can raise anything; say so in one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise AdapterError(f"adapter {spec!r}: its factory raised {type(exc).__name__}: {first}; fix the factory") from exc


@functools.cache
def load(spec: str):
    """Build the adapter named by `spec` (cached per process)."""
    if spec.startswith(DDP_CLASS_PREFIX):
        from conformance.adapters.ddp_like import DDPLikeAdapter

        ref = spec[len(DDP_CLASS_PREFIX):]
        cls = _import(ref, "--ddp-class")
        if not isinstance(cls, type):
            raise AdapterError(f"--ddp-class {ref!r} is not a class")
        from conformance.adapters.ddp_like import constructor_problem

        problem = constructor_problem(cls)
        if problem:
            raise AdapterError(f"--ddp-class {ref!r} is not DDP-like: {problem}; pass a class with torch DDP's constructor, or an adapter (--adapter)")
        module = importlib.import_module(cls.__module__.split(".")[0])
        version = getattr(cls, "__version__", getattr(module, "__version__", "unknown"))
        from conformance.adapters.ddp_like import class_semantics

        try:
            semantics = class_semantics(cls)
        except ValueError as exc:
            raise AdapterError(f"--ddp-class {ref!r}: {exc}") from None
        return DDPLikeAdapter(getattr(cls, "gradparity_name", cls.__name__), cls, version=str(version), semantics=semantics)
    known = known_adapters()
    if spec in known:
        factory = _import(known[spec], f"adapter {spec!r}")
    elif ":" in spec:
        factory = _import(spec, "adapter")
    else:
        raise AdapterError(f"unknown adapter {spec!r}; known: {', '.join(sorted(known))} (or pass pkg.module:factory)")
    adapter = _build(factory, spec) if callable(factory) and not hasattr(factory, "wrap") else factory
    for attr in ("name", "area", "capabilities"):
        if not hasattr(adapter, attr):
            raise AdapterError(f"adapter {spec!r} has no {attr!r}: see conformance.adapters.protocol.Adapter")
    return adapter


def ddp_class_spec(ref: str) -> str:
    return DDP_CLASS_PREFIX + ref
