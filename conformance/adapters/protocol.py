"""The adapter protocols: the seam between the suite and any data-parallel implementation.

An adapter object lives in each rank process (it is re-created there from its spec string,
so nothing unpicklable crosses processes). The DDP and sharded areas share `Adapter`/`Wrapped`;
other areas (data_parallel, bucketer, dist_autograd) declare small protocols of their own
next to their runners.

Protocol v2 (engines that own more than the reducer: DeepSpeed, FairScale OSS,
`ZeroRedundancyOptimizer`). All of it is optional; an adapter without it is driven as before.

- `Adapter.owns`: a subset of {"optimizer", "backward", "zero_grad"}.
  * "optimizer": `wrap(module, ctx, options, optimizer=OptimizerSpec)` is called with the
    scenario's optimizer, and `Wrapped.optimizer` is what the runner steps and zeroes.
  * "backward": the runner calls `Wrapped.backward(loss)` instead of `loss.backward()` (for
    engines that refuse a plain backward, e.g. DeepSpeed stage 0).
  * "zero_grad": the runner calls `Wrapped.zero_grad(set_to_none=...)` instead of the
    optimizer's.
  `Adapter.owns_for(scenario)` (optional) decides per scenario instead, for an engine whose own
  loop is needed only in some configurations (DeepSpeed ZeRO 1-3: bf16, accumulation).
  The default path stays the user's plain `loss.backward()`, `optimizer.zero_grad()` and
  `optimizer.step()`: that is where bugs like FairScale#354 (SDP + OSS silently wrong from step 2
  with `zero_grad(set_to_none=True)`) show, so own only what the engine cannot run without.
- `Wrapped.zero_grad(set_to_none=True)` (with `Capability.ENGINE_ZERO_GRAD`): the engine's own
  zero_grad, which scenarios with `zero_grad="engine"` call.
- `Adapter.semantics` (or `semantics_for(scenario)`): the rules where the engine legitimately
  differs from torch DDP (conformance.semantics): the oracle models them, the report shows them.
- `Adapter.unavailable(scenario)`: a reason to skip a scenario that cannot run here.
- `Adapter.ddp_module = True`: `Wrapped.ddp` is a torch-DDP-like module (its `state_dict`, `join`,
  `torch.compile` around it); DDP-like adapters have it, others must say so, or the production
  scenarios that need it (compile-wrapper, join, checkpoint round trip) are skipped.
- `Adapter.checkpoint_api = True`: the round trip goes through the engine instead:
  `Wrapped.checkpoint_state()` returns everything to restore, the optimizer's state included
  (it is `torch.save`d in memory), and `load_checkpoint_state(state)` is called on a fresh wrap.
- Every optional part above, with the default assumed where an adapter lacks it: `AdapterHooks`
  and `WrappedHooks` below (`conformance.adapters.optional`). A keyword a call gained later
  (`optimizer=` on `wrap`, `module_kwargs` on `data_parallel`) is read from the adapter's
  signature: an adapter written before it keeps running every scenario that does not pass it, and
  the scenarios that do are skipped at plan time with the one-line change to make.
- Case ids, and so `--xfails` lines, start with the adapter as given to `--adapter` (e.g.
  `mymod:factory|ddp/plain/mlp/w2/fp32`); `Adapter.name` is the name in skip reasons. An engine
  built on torch DDP inherits `conformance/adapters/xfails/torch-ddp.txt`'s known failures.

The loop each DDP-area runner drives (runners/ddp.py; runners/ddp_features.py adds the
features around the same skeleton), so an adapter author knows when each call happens::

    wrapped = adapter.wrap(model, ctx, options[, optimizer=OptimizerSpec])   # ctx: RankContext
    record init: wrapped.full_parameters(), wrapped.full_buffers()
    optimizer = wrapped.optimizer if "optimizer" in owns else torch optimizer(wrapped.optimizer_parameters())
    for step in range(steps):
        for micro in range(micro_batches):          # all but the last inside wrapped.no_sync()
            loss = loss_fn(wrapped(x, rank=ctx.rank, micro=micro))   # autocast around it (features)
            wrapped.backward(loss) if "backward" in owns else loss.backward()   # GradScaler-scaled (features)
            record wrapped.full_gradients()          # after EVERY backward, synced or not
        [features: wrapped.clip_grad_norm_(max) | torch clip | engine clips in step (OptimizerSpec.clip)]
        optimizer.step()                             # scaler.step(optimizer) with a GradScaler
        wrapped.zero_grad(...) if "zero_grad" in owns (or zero_grad="engine") else optimizer.zero_grad(...)
        record wrapped.full_parameters(), wrapped.full_buffers()
        [features, checkpoint round trip: wrapped.checkpoint_state() / load_checkpoint_state(state)
         with checkpoint_api = True, else torch DDP's wrapped.ddp.state_dict(); then a fresh wrap]
    record wrapped.allreduce_probe()                 # optional, collective on every rank (below)
    wrapped.close()                                  # optional; always called once the run is recorded

`Wrapped.allreduce_probe()` (optional) runs after training, on every rank, on the engine's own
process group: probe all-reduces whose results (recorded) let the oracle replay the backend's
summation order (`conformance.oracle.allreduce_order`). An engine judged by a nonlinear simulation of
its communication needs it at 3+ ranks (torch-ddp-powersgd); return None where not needed.

`ctx` is a `WrapContext` (below; the harness passes its `RankContext`, which has more): the
rank, the world size, the process group to hand the engine, the device and the backend.

A worked example (an engine with its own optimizer wrapper and zero-filled unused grads)::

    from conformance.adapters.ddp_like import DDPLikeWrapped, DDP_CAPABILITIES
    from conformance.semantics import Semantics, Unused

    class MyEngineAdapter:
        name, version, area = "my-engine", my_engine.__version__, "ddp"
        capabilities = DDP_CAPABILITIES - {Capability.SPARSE}
        owns = frozenset({"optimizer"})
        semantics = Semantics(unused=Unused.ZEROS, sources=("https://my-engine.dev/ddp#unused",))

        def wrap(self, module, ctx, options, optimizer=None):
            engine = my_engine.DDP(module, process_group=ctx.group)
            wrapped = DDPLikeWrapped(engine)  # calls engine; reads grads/params from engine.module
            wrapped.optimizer = my_engine.ShardedOptimizer(module.parameters(), optimizer.build)
            return wrapped

    def factory():  # gradparity run --adapter mypkg.adapters:factory
        return MyEngineAdapter()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from conformance.spec import Capability, WrapOptions


@runtime_checkable
class WrapContext(Protocol):
    """What `Adapter.wrap` may rely on about the rank it runs in (the harness's `RankContext`).

    Why a protocol: an adapter is written against these five attributes only, so it runs the
    same under the spawn pool, under torchrun (`conformance.frontends.torchrun`) and in a test's
    hand-made context; anything else on the harness's object may change.
    """

    @property
    def rank(self) -> int:
        """This rank's index in `group` (0 .. world_size-1); rank 0's state is the reference."""
        ...

    @property
    def world_size(self) -> int:
        """The number of ranks in `group` (the scenario's world size)."""
        ...

    @property
    def group(self) -> Any:
        """The `torch.distributed` process group the engine's collectives use: exactly this
        scenario's ranks. Today it is the default group (`dist.group.WORLD`) of a world the pool or
        torchrun started for this world size; the harness's only collective on it is one check
        all-reduce after each task (proving nothing was left pending), so an engine that reaches
        for the default group itself (Lightning Fabric, Accelerate, `fabric.save`'s barrier) is
        judged correctly. Hand the engine this
        group explicitly where it takes one: that keeps the adapter right if a world ever holds
        more ranks than a scenario."""
        ...

    @property
    def device(self) -> torch.device:
        """Where this rank's model and inputs live (`cpu`, or its `cuda:<i>`)."""
        ...

    @property
    def backend(self) -> str:
        """The group's backend (`gloo` or `nccl`): what an engine that picks collectives by backend needs."""
        ...


@runtime_checkable
class Wrapped(Protocol):
    """A module wrapped for data-parallel training, as the scenarios drive it."""

    module: nn.Module  # the user's module: parameter names come from it

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any: ...

    def no_sync(self) -> AbstractContextManager: ...

    def full_gradients(self) -> dict[str, Tensor | None]:
        """Unsharded gradients by parameter name (a collective for sharded implementations)."""
        ...

    def full_parameters(self) -> dict[str, Tensor]: ...

    def full_buffers(self) -> dict[str, Tensor]: ...

    def optimizer_parameters(self) -> Iterable[nn.Parameter]:
        """What the optimizer steps (the sharded parameters for a sharded implementation)."""
        ...


OWNABLE = frozenset({"optimizer", "backward", "zero_grad"})


class AdapterHooks:
    """The optional parts of an adapter, with the default the suite assumes where one is absent.

    Define only those you need (the suite reads each with `conformance.adapters.optional.hook`,
    which falls back to these defaults), or subclass this to have them spelled out. What each
    does: the module docstring above; `optional.ADAPTER_HOOKS` says it in one line each.
    """

    owns: frozenset[str] = frozenset()
    owns_for: Callable[[Any], frozenset[str]] | None = None  # owns_for(scenario)
    semantics: Any = None  # conformance.semantics.Semantics; None: torch DDP's
    semantics_for: Callable[[Any], Any] | None = None  # semantics_for(scenario) -> Semantics
    unavailable: Callable[[Any], str | None] | None = None  # unavailable(scenario) -> reason to skip
    ddp_module: bool | None = None  # None: judged by the adapter's class (DDP-like adapters have it)
    checkpoint_api: bool = False
    deterministic: bool = False
    chunk_sizes: Callable[[int, int], Any] | None = None  # data_parallel: chunk_sizes(rows, replicas)
    devices: Callable[[Any], list] | None = None  # data_parallel: devices(scenario)
    cls: type | None = None  # the engine class a DDP-like adapter wraps (its version is reported)


class WrappedHooks:
    """The optional parts of a `Wrapped`, with their defaults (None: the suite does without)."""

    zero_grad: Callable[..., None] | None = None  # zero_grad(set_to_none=True)
    backward: Callable[[Tensor], None] | None = None  # backward(loss), owns "backward"
    optimizer: Any = None  # owns "optimizer"
    clip_grad_norm_: Callable[[float], Any] | None = None
    checkpoint_state: Callable[[], Any] | None = None  # checkpoint_api
    load_checkpoint_state: Callable[[Any], None] | None = None  # checkpoint_api
    allreduce_probe: Callable[[], Any] | None = None
    local_shards: Callable[[], Any] | None = None
    backward_stats: Callable[[], dict | None] | None = None
    close: Callable[[], None] | None = None
    ddp: Any = None


@dataclass(frozen=True)
class OptimizerSpec:
    """The scenario's optimizer, for adapters that build their own (protocol v2, owns "optimizer").

    `build(params)` returns the same torch optimizer the oracle steps; `name`, `lr` and
    `kwargs` describe it for engines configured from data (DeepSpeed's JSON config).
    """

    name: str  # "sgd" | "adam" | "none"
    # The production-training scenarios (conformance.features) train at their own learning rate
    # and may clip: an engine that owns the optimizer applies both its own way (DeepSpeed's
    # `gradient_clipping`, `OSS.clip_grad_norm`), the oracle clips the global norm.
    lr: float | None = None
    clip: float | None = None  # max global L2 norm of the averaged gradients before each step
    # Micro-batches per optimizer step (the scenario's; all but the last inside no_sync()): an engine
    # that accumulates by itself (DeepSpeed's gradient_accumulation_steps) is configured with it.
    micro_batches: int = 1

    def build(self, params) -> object | None:
        from conformance.models.data import make_optimizer

        opt = make_optimizer(self.name, params)
        if opt is not None and self.lr is not None:
            for group in opt.param_groups:
                group["lr"] = self.lr
        return opt

    @property
    def torch_class(self) -> Callable | None:
        import torch

        return {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}.get(self.name)

    @property
    def hyperparameters(self) -> dict:
        from conformance.models.data import OPTIMIZER_SETTINGS

        settings = dict(OPTIMIZER_SETTINGS.get(self.name, {}))
        if self.lr is not None and settings:
            settings["lr"] = self.lr
        return settings


@runtime_checkable
class Adapter(Protocol):
    name: str
    version: str
    area: str  # which area's scenarios it runs: "ddp", "sharded", "data_parallel", ...
    capabilities: frozenset[Capability]

    def wrap(self, module: nn.Module, ctx: WrapContext, options: WrapOptions) -> Wrapped: ...


def owned(adapter, scenario=None) -> frozenset[str]:
    """What the adapter takes over from the user's plain training loop (protocol v2).

    `Adapter.owns_for(scenario)`, where an adapter defines it, decides per scenario: an engine
    whose own loop is needed only for some configurations (DeepSpeed ZeRO 1-3: `engine.backward`
    for its loss scaling and gradient accumulation, the user's plain `loss.backward()` otherwise)
    is driven the user's way wherever it can be.
    """
    from conformance.adapters.optional import hook

    per_scenario = hook(adapter, "owns_for")
    chosen = per_scenario(scenario) if scenario is not None and callable(per_scenario) else hook(adapter, "owns")
    owns = frozenset(chosen or ())
    unknown = owns - OWNABLE
    if unknown:
        raise ValueError(f"adapter {adapter.name!r} owns {sorted(unknown)}: only {sorted(OWNABLE)} can be owned")
    return owns


def missing_capabilities(adapter: Adapter, required: Iterable[Capability]) -> list[Capability]:
    return sorted((c for c in required if c not in adapter.capabilities), key=lambda c: c.value)
