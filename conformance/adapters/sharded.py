"""Adapters of the `sharded` area: the DDP contract on *gathered* gradients and parameters.

A sharded implementation holds 1/W of the gradients (and, for FSDP, of the parameters) on
each rank; the suite reads them through the same `Wrapped` protocol as DDP's, so every
`full_*` method here is a collective that rebuilds the unsharded tensors. Built-ins:

* ``refimpl-sharded`` — :class:`refimpl.sharded.ShardedDataParallel` (ZeRO-2: replicated
  parameters, reduce-scattered gradients through the bucketer, a sharded optimizer).
* ``refimpl-zero3`` — :class:`refimpl.sharded.zero3.FullyShardedDataParallel` (ZeRO-3:
  parameters sharded at rest and all-gathered per unit, same bucketer and optimizer).
* ``torch-fsdp`` — ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1), one root
  unit, ``use_orig_params=True`` (so the optimizer and the suite see the module's own
  parameter names), ``sync_module_states=True`` (construction-time sync from rank 0).
* ``torch-fsdp2`` (`conformance.adapters.sharded_fsdp2`) — ``torch.distributed.fsdp.fully_shard`` (FSDP2, DTensor parameters) on
  the root module. ``fully_shard`` does no construction-time sync: like a user would, the
  adapter broadcasts rank 0's parameters and buffers *before* sharding (FSDP2's docs ask
  for a rank-0 broadcast or a full-state-dict load).

What the suite observes inside ``no_sync()`` is each rank's *local* accumulated gradient.
Sharded implementations keep it in internal buffers (none exposes it publicly), so the
wrappers read it from where each keeps it; see each class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from conformance.adapters import sharded_state
from conformance.spec import Capability, Scenario, WrapOptions
from refimpl import _torch_compat as compat

C = Capability


def _cpu(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)


@torch.no_grad()
def _broadcast_from_rank0(module: nn.Module, group) -> None:
    """What FSDP2 (and FSDP1 on CPU) leave to the user: rank 0's parameters and buffers everywhere."""
    src = dist.get_global_rank(group, 0)
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src=src, group=group)


def hsdp_mesh(ctx, replicas: int):
    """The (replicate, shard) DeviceMesh of a HSDP scenario over the pool's ranks (issue #26).

    One per rank process and shape, kept in ``ctx.scratch`` and reused by every HSDP case: a
    mesh per case made new process groups (NCCL communicators) in a warm rank at every case.
    Destroying them after the case is no answer: torch resolves groups by name from caches that
    outlive the mesh (a later case's FSDP2 ``full_tensor`` raised "Could not resolve the process
    group registered under the name 3").
    """
    from torch.distributed.device_mesh import DeviceMesh

    W = ctx.world_size
    assert W % replicas == 0, f"hsdp_replicas={replicas} does not divide the world size {W}"
    key = ("hsdp_mesh", id(ctx.group), replicas, ctx.device.type)
    if key not in ctx.scratch:  # collective over the world: every rank gets here in the same case
        ctx.scratch[key] = DeviceMesh(ctx.device.type, torch.arange(W).view(replicas, W // replicas),
                                      mesh_dim_names=("replicate", "shard"))
    return ctx.scratch[key]


def unit_modules(module: nn.Module, *, split_shared: bool = True) -> list[nn.Module]:
    """The blocks a scenario's ``units="children"`` makes units of their own (issue #26).

    A direct child that is a ``ModuleList``/``Sequential`` gives its items, any other direct
    child with parameters is itself a unit. ``split_shared=False`` keeps modules that share a
    parameter with another block in the root unit (FSDP2 asks for that: a shared parameter
    belongs to the common parent's ``fully_shard``).
    """
    blocks = []
    for child in module.children():
        items = list(child) if isinstance(child, (nn.ModuleList, nn.Sequential)) else [child]
        blocks += [m for m in items if any(True for _ in m.parameters())]
    if split_shared:
        return blocks
    owners: dict[int, int] = {}
    for m in blocks:
        for p in m.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [m for m in blocks if all(owners[id(p)] == 1 for p in m.parameters())]


# -- refimpl ------------------------------------------------------------------------------------
class RefimplShardedWrapped:
    """Drives :class:`refimpl.sharded.ShardedDataParallel` through the calls its users make.

    Forward, ``no_sync()``, the user's ``loss.backward()``, the engine's own
    ``ShardedOptimizer`` (``make_optimizer``: steps this rank's shards, then all-gathers the
    parameters) and the public ``full_gradients()`` / ``full_parameters()`` collectives. Only
    inside ``no_sync()`` does the suite look at the wrapped module's ``p.grad``: that is where
    the engine documents the local accumulation stays until the next synced backward.
    """

    def __init__(self, sdp, optimizer=None):
        self.sdp = sdp
        self.module = sdp.module
        self.optimizer = optimizer
        self._synced_forward = True

    def __call__(self, *inputs, **kwargs):
        self._synced_forward = self.sdp.require_backward_grad_sync
        return self.sdp(*inputs, **kwargs)

    def no_sync(self) -> AbstractContextManager:
        return self.sdp.no_sync()

    def full_gradients(self) -> dict[str, Tensor | None]:
        if not self._synced_forward:  # local accumulation: still in the full p.grad
            return {n: _cpu(p.grad) for n, p in self.module.named_parameters() if p.requires_grad}
        grads = self.sdp.full_gradients()
        return {n: _cpu(grads[n]) for n, p in self.module.named_parameters() if p.requires_grad}

    def full_parameters(self) -> dict[str, Tensor]:
        return {n: _cpu(t) for n, t in self.sdp.full_parameters().items()}

    def full_buffers(self) -> dict[str, Tensor]:
        return {n: _cpu(b) for n, b in self.module.named_buffers()}

    def optimizer_parameters(self) -> Iterable[nn.Parameter]:
        return self.sdp.sharded_parameters()

    def clip_grad_norm_(self, max_norm: float):
        """The engine's global-norm clip (the path its users call; torch's would see one shard)."""
        return self.sdp.clip_grad_norm_(max_norm)

    def local_shards(self) -> dict[str, dict]:
        """This rank's own chunks (conformance/judge/shards.py): refimpl's flat-chunk placement."""
        return {n: {"placement": "flat-chunk", "param": _cpu(p), "grad": _cpu(g)}
                for n, (p, g) in self.sdp.local_shards().items()}

    def checkpoint(self, kind: str, optimizer) -> dict:
        """Model + optimizer state, "sharded" (DTensors for DCP) or "full" (refimpl.sharded.checkpoint)."""
        return sharded_state.refimpl_state(self.sdp, kind, optimizer)

    def load_checkpoint(self, kind: str, state: dict, optimizer) -> None:
        sharded_state.refimpl_load(self.sdp, kind, state, optimizer)


def sharded_optimizer(sdp, optimizer) -> object | None:
    """The scenario's optimizer as refimpl's ``ShardedOptimizer`` (None: the scenario has none)."""
    if optimizer is None or optimizer.name == "none":
        return None
    return sdp.make_optimizer(optimizer.build)


def refimpl_sharded_kwargs(options: WrapOptions) -> dict:
    kwargs = {"broadcast_buffers": options.broadcast_buffers}
    if options.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = options.bucket_cap_mb
    return kwargs


class RefimplSharded:
    """refimpl's sharded engine owns its optimizer (protocol v2): ``ShardedOptimizer`` is the
    path its users call, so it is the path the suite checks."""

    name = "refimpl-sharded"
    area = "sharded"
    capabilities = frozenset({C.NO_SYNC, C.FIND_UNUSED, C.BUCKET_CAP, C.BUFFER_BROADCAST, C.HALF_PRECISION,
                              C.STATE_DICT})
    owns = frozenset({"optimizer"})

    def __init__(self):
        import refimpl

        self.version = getattr(refimpl, "__version__", "0")

    def wrap(self, module: nn.Module, ctx, options: WrapOptions, optimizer=None) -> RefimplShardedWrapped:
        from refimpl.sharded import ShardedDataParallel

        sdp = ShardedDataParallel(module, process_group=ctx.group, **refimpl_sharded_kwargs(options))
        return RefimplShardedWrapped(sdp, sharded_optimizer(sdp, optimizer))


# -- refimpl ZeRO-3 -----------------------------------------------------------------------------
class RefimplZero3Wrapped(RefimplShardedWrapped):
    """Drives :class:`refimpl.sharded.zero3.FullyShardedDataParallel` (parameters sharded too).

    The module's parameters hold no values at rest, so parameters are read only through the
    engine's ``full_parameters()`` collective; ``local_shards()`` is each rank's own chunk.
    """

    def __init__(self, sdp, optimizer=None, rs_only: bool = False):
        super().__init__(sdp, optimizer)
        self.rs_only = rs_only  # HSDP: no_sync() is set_requires_all_reduce(False) (S21)

    def no_sync(self) -> AbstractContextManager:
        return self.sdp.no_all_reduce() if self.rs_only else self.sdp.no_sync()

    def full_gradients(self) -> dict[str, Tensor | None]:
        if not self._synced_forward:  # local sums kept in reduce_dtype, else still in p.grad
            return {n: _cpu(q.acc if q.acc is not None else q.param.grad) for n, q in
                    ((q.name, q) for q in self.sdp._params)}
        return super().full_gradients()

    def full_parameters(self) -> dict[str, Tensor]:
        return {n: _cpu(t) for n, t in self.sdp.full_parameters().items()}

    def local_shards(self) -> dict[str, dict]:
        """flat-chunk, or dim{d}-chunk for a parameter a shard_placement_fn put on dim d > 0 (S18)."""
        from refimpl.sharded.placement import shard_view

        out = super().local_shards()
        for q in self.sdp._params:
            if q.dim and q.name in out:
                entry, W = out[q.name], self.sdp.world_size
                out[q.name] = {"placement": f"dim{q.dim}-chunk", "param": shard_view(entry["param"], q.shape, q.dim, W),
                               "grad": None if entry["grad"] is None else shard_view(entry["grad"], q.shape, q.dim, W)}
        return out


def refimpl_zero3_kwargs(module: nn.Module, options: WrapOptions, ctx=None) -> dict:
    """Constructor keywords; with ``ctx``, the process groups too (HSDP: the mesh's two groups)."""
    kwargs = refimpl_sharded_kwargs(options)
    if ctx is not None:
        kwargs["process_group"] = ctx.group
        if options.hsdp_replicas:
            mesh = hsdp_mesh(ctx, options.hsdp_replicas)
            kwargs.update(process_group=mesh.get_group("shard"), replicate_group=mesh.get_group("replicate"))
    if options.units == "children":
        kwargs["units"] = unit_modules(module)  # the engine owns shared parameters in the common ancestor
    if options.reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = options.reshard_after_forward
    if options.shard_placement:  # FSDP2's shard_placement_fn, the scenario's rule (conformance.judge.shards)
        from conformance.judge.shards import placement_dim

        # The rule reads the world size, as the judge and FSDP2's adapter do (under HSDP not the shard group's)
        W = ctx.world_size if ctx is not None else dist.get_world_size()
        kwargs["shard_placement_fn"] = lambda p, rule=options.shard_placement: placement_dim(rule, tuple(p.shape), W)
    if options.param_dtype:  # issue #26: the mixed-precision policy (conformance.oracle.baseline_mixed)
        from refimpl.sharded.zero3 import MixedPrecisionPolicy

        kwargs["mixed_precision"] = MixedPrecisionPolicy(*mp_dtypes(options))
    return kwargs


def mp_dtypes(options: WrapOptions) -> tuple[torch.dtype, torch.dtype | None]:
    """(param_dtype, reduce_dtype) of a scenario's mixed-precision policy, as torch dtypes."""
    reduce = getattr(torch, options.reduce_dtype) if options.reduce_dtype else None
    return getattr(torch, options.param_dtype), reduce


class RefimplZero3(RefimplSharded):
    """refimpl's ZeRO-3 engine: one root unit (the suite's scenarios may use rank-dependent
    control flow, which per-unit all-gathers cannot serve: see the engine's notes)."""

    name = "refimpl-zero3"
    capabilities = RefimplSharded.capabilities | {C.SHARD_UNITS, C.RESHARD, C.RESHARD_INT, C.MIXED_PRECISION,
                                                  C.HSDP, C.HSDP_RS_ACCUMULATION, C.SHARD_PLACEMENT}

    def wrap(self, module: nn.Module, ctx, options: WrapOptions, optimizer=None) -> RefimplZero3Wrapped:
        from refimpl.sharded.zero3 import FullyShardedDataParallel

        fsdp = FullyShardedDataParallel(module, **refimpl_zero3_kwargs(module, options, ctx))
        return RefimplZero3Wrapped(fsdp, sharded_optimizer(fsdp, optimizer), options.accumulate_reduce_scattered)

    def unavailable(self, scenario: Scenario) -> str | None:
        if scenario.options.shard_placement and dict(scenario.features).get("state_dict"):
            # refimpl/sharded/checkpoint.py, _shards: a documented refusal with a clear error
            return ("refimpl ZeRO-3's model + optimizer state dicts keep the flat-chunk layout and refuse parameters "
                    "a shard_placement_fn put on dim 1 (the engine's model-only full_state_dict takes them)")
        return None


# -- torch FSDP (FSDP1) -------------------------------------------------------------------------
class FSDPWrapped:
    """Drives one root ``FullyShardedDataParallel`` unit with ``use_orig_params=True``.

    Full gradients and parameters come from ``FSDP.summon_full_params(with_grads=True)``
    (public API, a collective). Inside ``no_sync()`` FSDP keeps the local unsharded gradient
    and leaves the parameters unsharded; ``summon_full_params`` then shows exactly that.
    """

    def __init__(self, fsdp):
        self.fsdp = fsdp
        self.module = fsdp.module
        self._sync = True
        self._synced_forward = True

    def __call__(self, *inputs, **kwargs):
        self._synced_forward = self._sync
        return self.fsdp(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            with self.fsdp.no_sync():
                yield
        finally:
            self._sync = True

    def _local_accumulated(self) -> dict[str, Tensor | None]:
        """Inside no_sync() FSDP keeps the local *unsharded* flat gradient on the FlatParameter
        (``summon_full_params(with_grads=True)`` then asserts it is sharded); split it with
        the handle's own unflattening (private, read only)."""
        flat = compat.fsdp_flat_param(self.fsdp)
        by_name: dict[str, Tensor | None] = {}
        if flat.grad is not None and flat.grad.numel() != flat.numel():
            by_name = compat.fsdp_unflat_views(self.fsdp, flat.grad)
        return {n: _cpu(by_name.get(n)) for n, p in self._names() if p.requires_grad}

    def _names(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.named_parameters())

    def full_gradients(self) -> dict[str, Tensor | None]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if not self._synced_forward:
            return self._local_accumulated()
        with FSDP.summon_full_params(self.fsdp, writeback=False, with_grads=True):
            return {n: _cpu(p.grad) for n, p in self._names() if p.requires_grad}

    def full_parameters(self) -> dict[str, Tensor]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(self.fsdp, writeback=False):
            return {n: _cpu(p) for n, p in self._names()}

    def full_buffers(self) -> dict[str, Tensor]:
        return {n: _cpu(b) for n, b in self.module.named_buffers()}

    def optimizer_parameters(self) -> Iterable[nn.Parameter]:
        return [p for p in self.fsdp.parameters() if p.requires_grad]

    def clip_grad_norm_(self, max_norm: float):
        """FSDP1's own clip (documented for FSDP: torch's clip_grad_norm_ would see local shards)."""
        return self.fsdp.clip_grad_norm_(max_norm)

    def checkpoint(self, kind: str, optimizer) -> dict:
        """torch's get_state_dict on the root unit (conformance.adapters.sharded_state)."""
        return sharded_state.torch_state(self.fsdp, kind, optimizer)

    def load_checkpoint(self, kind: str, state: dict, optimizer) -> None:
        sharded_state.torch_load(self.fsdp, kind, state, optimizer)


class TorchFSDP:
    """FSDP1 declares no rank-0 buffer broadcast before forward (FSDP has no such option;
    buffers are synced once, at construction) and no bucket cap (its unit is the wrap)."""

    name = "torch-fsdp"
    area = "sharded"
    # RESHARD: reshard_after_forward=False is ShardingStrategy.SHARD_GRAD_OP; no nested units
    # here (the adapter reads the local no_sync() gradient from the root's flat parameter).
    capabilities = frozenset({C.NO_SYNC, C.FIND_UNUSED, C.HALF_PRECISION, C.RESHARD, C.HSDP, C.STATE_DICT,
                              C.CPU_OFFLOAD, C.MIXED_PRECISION})
    version = torch.__version__

    def semantics_for(self, scenario: Scenario):
        """Under a mixed-precision policy FSDP1 keeps a no_sync() sum in param_dtype: its post-backward
        hook returns before casting to reduce_dtype when not syncing (torch/distributed/fsdp/_runtime_utils.py,
        ``_post_backward_hook``), so autograd adds the micro-batches in the bf16 flat gradient."""
        if not scenario.options.param_dtype:
            return None
        from conformance.semantics import MixedAccumulation, Semantics

        return Semantics(mixed_accumulation=MixedAccumulation.PARAM_DTYPE,
                         sources=("torch/distributed/fsdp/_runtime_utils.py: _post_backward_hook returns when "
                                  "not _sync_gradients, before flat_param.grad.to(handle._reduce_dtype)",))

    def wrap(self, module: nn.Module, ctx, options: WrapOptions) -> FSDPWrapped:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # FSDP's own construction-time sync refuses CPU tensors ("The module has CPU
        # parameters or buffers when `sync_module_states=True`, which requires them to be on
        # GPU"), so on CPU the adapter broadcasts rank 0's state itself, as a user must.
        on_gpu = ctx.device.type == "cuda"
        if not on_gpu:
            _broadcast_from_rank0(module, ctx.group)
        from torch.distributed.fsdp import ShardingStrategy

        strategy = ShardingStrategy.SHARD_GRAD_OP if options.reshard_after_forward is False else ShardingStrategy.FULL_SHARD
        where = {"process_group": ctx.group}
        if options.hsdp_replicas:  # HYBRID_SHARD on a (replicas, W // replicas) mesh
            strategy, where = ShardingStrategy.HYBRID_SHARD, {"device_mesh": hsdp_mesh(ctx, options.hsdp_replicas)}
        if options.cpu_offload:  # FSDP1's offload: parameters (and so gradients and the step) on CPU
            from torch.distributed.fsdp import CPUOffload

            where["cpu_offload"] = CPUOffload(offload_params=True)
        if options.param_dtype:  # FSDP1's MixedPrecision: parameters and reduce dtype (buffers untouched)
            from torch.distributed.fsdp import MixedPrecision

            param, reduce = mp_dtypes(options)
            where["mixed_precision"] = MixedPrecision(param_dtype=param, reduce_dtype=reduce)
        fsdp = FSDP(
            module, device_id=ctx.device, use_orig_params=True, sync_module_states=on_gpu,
            sharding_strategy=strategy, **where,
        )
        return FSDPWrapped(fsdp)

    def unavailable(self, scenario: Scenario) -> str | None:
        if scenario.options.cpu_offload and not compat.accelerator_available():
            # torch 2.13, FlatParamHandle.init_flat_param_attributes: the CPU shard is always pinned
            return ("FSDP1's CPUOffload(offload_params=True) pins its CPU shard (pin_memory()), which torch refuses "
                    "without an accelerator: 'Cannot access accelerator device when none is available'")
        return None


def refimpl_sharded() -> RefimplSharded:
    return RefimplSharded()


def refimpl_zero3() -> RefimplZero3:
    return RefimplZero3()


def torch_fsdp() -> TorchFSDP:
    return TorchFSDP()
