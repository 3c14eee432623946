"""A generic adapter for any class whose constructor and `no_sync()` follow torch's DDP.

This is what `--ddp-class pkg.module:Class` uses, and what the built-in `torch-ddp` and
`refimpl-ddp` adapters are: the only difference between them is the class and the comm hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from conformance.spec import Capability, WrapOptions

DDP_CAPABILITIES = frozenset(
    {
        Capability.NO_SYNC,
        Capability.FIND_UNUSED,
        Capability.SPARSE,
        Capability.STATIC_GRAPH,
        Capability.GRAD_AS_BUCKET_VIEW,
        Capability.COMM_HOOK,
        Capability.BUCKET_CAP,
        Capability.BUFFER_BROADCAST,
        Capability.HALF_PRECISION,
        Capability.ENGINE_ZERO_GRAD,
        Capability.JOIN,
        Capability.MIXED_PRECISION,
    }
)


def torch_comm_hooks() -> dict[str, Callable]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        "allreduce": default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
    }


def _cpu(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    t = t.detach()
    if t.is_sparse:
        t = t.coalesce().to_dense()
    return t.to("cpu", copy=True)


class DDPLikeWrapped:
    """Drives a DDP-like object; reads gradients and parameters from its `.module`."""

    def __init__(self, ddp: nn.Module):
        self.ddp = ddp
        self.module = ddp.module

    def __call__(self, *inputs, **kwargs):
        return self.ddp(*inputs, **kwargs)

    def no_sync(self) -> AbstractContextManager:
        return self.ddp.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapper's own zero_grad (an nn.Module's, unless the engine overrides it)."""
        self.ddp.zero_grad(set_to_none=set_to_none)

    def full_gradients(self) -> dict[str, Tensor | None]:
        return {n: _cpu(p.grad) for n, p in self.module.named_parameters() if p.requires_grad}

    def full_parameters(self) -> dict[str, Tensor]:
        return {n: _cpu(p) for n, p in self.module.named_parameters()}

    def full_buffers(self) -> dict[str, Tensor]:
        return {n: _cpu(b) for n, b in self.module.named_buffers()}

    def optimizer_parameters(self) -> Iterable[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def backward_stats(self) -> dict | None:
        """The last backward's bucket timeline, if the implementation reports one.

        Either a `backward_stats()` dict, or refimpl's `get_backward_stats()`; each bucket gets
        a `ready_ns` (its first gradient's arrival) so the report can draw fill vs in-flight.
        """
        stats = getattr(self.ddp, "backward_stats", None)
        if callable(stats):
            return stats()
        getter = getattr(self.ddp, "get_backward_stats", None)
        if not callable(getter):
            return None
        data = getter().as_dict()
        ready = data.get("param_ready_ns") or []
        for bucket in data.get("buckets", []):
            times = [ready[i] for i in bucket.get("param_indices", []) if i < len(ready) and ready[i] is not None]
            bucket["ready_ns"] = min(times) if times else bucket.get("launch_ns")
        return data


class DDPLikeAdapter:
    """Wraps modules with `cls(module, process_group=..., <torch DDP keywords>)`."""

    area = "ddp"

    def __init__(
        self,
        name: str,
        cls: type,
        *,
        version: str,
        capabilities: frozenset[Capability] = DDP_CAPABILITIES,
        comm_hooks: Callable[[], dict[str, Callable]] = torch_comm_hooks,
        semantics=None,
    ):
        self.name, self.cls, self.version = name, cls, version
        declared = getattr(cls, "gradparity_capabilities", None)
        # A class that declares its capabilities is taken at its word; otherwise a capability
        # whose method or constructor keyword the class lacks is dropped, so its scenarios are
        # skipped with the capability named instead of failing.
        self.capabilities = frozenset(declared) if declared is not None else capabilities - missing_capabilities_of(cls)
        # Declared bitwise run-to-run determinism (checked by the `determinism` scenarios).
        self.deterministic = bool(getattr(cls, "gradparity_deterministic", False))
        self._comm_hooks = comm_hooks
        if semantics is not None:
            self.semantics = semantics

    def unavailable(self, scenario) -> str | None:
        """Why a scenario cannot run here at all (a skip with the reason, never a pass)."""
        if (
            scenario.options.comm_hook == "bf16"
            and scenario.device == "cpu"
            and _same_definition(self._comm_hooks, torch_comm_hooks)
        ):
            return "torch's bf16_compress_hook needs CUDA 11+ and NCCL 2.10+ (it refuses gloo on CPU)"
        if scenario.options.reduce_dtype and scenario.device == "cpu" and _same_definition(self.cls, _torch_ddp_class()):
            # torch/nn/parallel/distributed.py: _MixedPrecision's reduce records CUDA events (forward
            # raises "cpu backend doesn't support events" on CPU/gloo)
            return "torch DDP's mixed_precision reduce_dtype records CUDA events (CPU/gloo raises)"
        return None

    def semantics_for(self, scenario):
        """torch DDP's rules (or the subclass's `semantics`), plus the lossy bound of a
        `reduce_dtype` scenario: what `mixed_precision=_MixedPrecision(reduce_dtype=...)` documents."""
        from conformance.semantics import TORCH_DDP, with_reduce_dtype

        return with_reduce_dtype(getattr(self, "semantics", None) or TORCH_DDP, scenario)

    def wrap(self, module: nn.Module, ctx, options: WrapOptions) -> DDPLikeWrapped:
        kwargs = dict(
            process_group=ctx.group,
            find_unused_parameters=options.find_unused_parameters,
        )
        if not options.broadcast_buffers:  # passed only when off: torch 2.13 warns on the keyword
            kwargs["broadcast_buffers"] = False
        if ctx.device.type == "cuda":
            kwargs["device_ids"] = [ctx.device.index]
        if options.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = options.bucket_cap_mb
        if options.gradient_as_bucket_view:
            kwargs["gradient_as_bucket_view"] = True
        if options.static_graph:
            kwargs["static_graph"] = True
        if options.reduce_dtype:
            from conformance.models.data import DTYPES
            from refimpl._torch_compat import ddp_mixed_precision

            kwargs["mixed_precision"] = ddp_mixed_precision(DTYPES[options.reduce_dtype])
        ddp = self.cls(module, **kwargs)
        if options.comm_hook:
            hooks = self._comm_hooks()
            if options.comm_hook not in hooks:
                raise ValueError(f"{self.name}: no comm hook named {options.comm_hook!r}; known: {sorted(hooks)}")
            ddp.register_comm_hook(ctx.group, hooks[options.comm_hook])
        return DDPLikeWrapped(ddp)


def class_semantics(cls: type):
    """The rules a `--ddp-class` class declares in `gradparity_semantics` (next to
    `gradparity_capabilities`): a `conformance.semantics.Semantics`, or only where it applies
    1/W (a `Scaling`, or "pre" / "post"). Undeclared: either exact placement of 1/W passes
    (`Scaling.EITHER`) and the report says which one the engine matched. ValueError (one line)
    for anything else."""
    from conformance.semantics import Scaling, Semantics

    declared = getattr(cls, "gradparity_semantics", None)
    if declared is None:
        return Semantics(scaling=Scaling.EITHER)
    if isinstance(declared, Semantics):
        return declared
    try:
        return Semantics(scaling=Scaling(declared), sources=(f"{cls.__name__}.gradparity_semantics",))
    except ValueError:
        raise ValueError(f"{cls.__name__}.gradparity_semantics is {declared!r}; declare a conformance.semantics.Semantics, "
                         f"or where 1/W is applied: 'pre' (each share) or 'post' (the sum)") from None


# What a capability needs from a DDP-like class: a method, or a constructor keyword.
CAPABILITY_METHODS = {Capability.NO_SYNC: "no_sync", Capability.COMM_HOOK: "register_comm_hook",
                      Capability.JOIN: "join"}  # uneven inputs need torch's join() API
CAPABILITY_KEYWORDS = {
    Capability.BUCKET_CAP: "bucket_cap_mb", Capability.GRAD_AS_BUCKET_VIEW: "gradient_as_bucket_view",
    Capability.STATIC_GRAPH: "static_graph", Capability.BUFFER_BROADCAST: "broadcast_buffers",
    Capability.MIXED_PRECISION: "mixed_precision",
}
REQUIRED_KEYWORDS = ("process_group", "find_unused_parameters")  # DDPLikeAdapter.wrap always passes these


def _signature(cls: type):
    import inspect

    try:
        return inspect.signature(cls)
    except (TypeError, ValueError):  # a C extension without a signature: nothing to check
        return None


def missing_capabilities_of(cls: type) -> frozenset[Capability]:
    """Capabilities a DDP-like class cannot offer: a missing method or constructor keyword."""
    missing = {cap for cap, method in CAPABILITY_METHODS.items() if not callable(getattr(cls, method, None))}
    sig = _signature(cls)
    if sig is not None and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        missing |= {cap for cap, kw in CAPABILITY_KEYWORDS.items() if kw not in sig.parameters}
    return frozenset(missing)


def constructor_problem(cls: type) -> str | None:
    """Why `cls(module, process_group=..., find_unused_parameters=...)` cannot work, or None.

    Checked on the signature, before any process starts: a class that is not DDP-like (say
    `torch.nn:Linear`) would otherwise fail every scenario the same way.
    """
    if not isinstance(cls, type):
        return "it is not a class"
    sig = _signature(cls)
    if sig is None:
        return None
    try:
        sig.bind(object(), **{kw: None for kw in REQUIRED_KEYWORDS})
    except TypeError as exc:
        return f"{cls.__name__}{sig} cannot be called like torch DDP, cls(module, process_group=..., find_unused_parameters=...): {exc}"
    return None


def _same_definition(a, b) -> bool:
    """The same function or class by where it is defined, not by identity: a test that re-imports
    a module (or patches torch's DDP name) makes new objects of the same definition."""
    return (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == \
        (getattr(b, "__module__", None), getattr(b, "__qualname__", None))


def _torch_ddp_class() -> type:
    """torch's DDP from the module that defines it: a process that swaps another class in for
    `torch.nn.parallel.DistributedDataParallel` (a drop-in swap, as refimpl's DDP allows; torch's
    own DDP tests run on refimpl do so in their ranks) still gets torch's under `torch-ddp`."""
    from torch.nn.parallel.distributed import DistributedDataParallel

    return DistributedDataParallel


def torch_ddp() -> DDPLikeAdapter:
    return DDPLikeAdapter("torch-ddp", _torch_ddp_class(), version=torch.__version__)


def refimpl_ddp() -> DDPLikeAdapter:
    import refimpl
    from refimpl.ddp import DistributedDataParallel, comm_hooks

    def hooks() -> dict[str, Callable]:
        return {
            "allreduce": comm_hooks.allreduce_hook,
            "fp16": comm_hooks.fp16_compress_hook,
            "bf16": comm_hooks.bf16_compress_hook,
        }

    adapter = DDPLikeAdapter("refimpl-ddp", DistributedDataParallel, version=refimpl.__version__, comm_hooks=hooks)
    adapter.deterministic = True  # same inputs, same collectives in the same order: bitwise the same
    # No declared semantics: refimpl scales each share by fl(1/W) before the sum, as torch DDP
    # does (refimpl/ddp/buckets.py [Note: where 1/W is applied]), so torch DDP's rules apply.
    return adapter
