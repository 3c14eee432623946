"""FullyShardedDataParallel: parameters, gradients and optimizer state sharded (ZeRO-3).

What each rank holds at rest (between steps): for every trainable parameter, one chunk of
its flattened value, of its gradient and of its optimizer state — 1/W of the total. The
wrapped module keeps its ``nn.Parameter`` objects (names, identity, shapes), but their storage
is freed: a parameter has values only while its *unit* needs them.

Frozen parameters (``requires_grad=False``) stay replicated, as the module holds them.

A unit is a submodule whose parameters are gathered together (one all-gather per dtype):
the root module always, and each module ``units`` names (FSDP's nested wrapping; e.g. every
block of a transformer). A parameter belongs to the innermost unit containing every module
that registers it, so a parameter shared between units is owned by their common ancestor.

One training step:
  1. before a unit's forward, its parameters are all-gathered from the shards (cast to the
     policy's ``param_dtype`` first, as FSDP2 does: the all-gather moves the compute dtype);
  2. after a non-root unit's forward, with ``reshard_after_forward=True``, its parameters are
     freed again, and gathered once more before its backward (a hook on its outputs); with an
     int ``k``, each rank keeps 1/k of them and the backward gathers within a group of ``k``
     ranks (``refimpl.sharded.reshard``, FSDP2's meaning);
  3. as soon as a non-root unit's backward is done (a hook on its forward inputs), its
     gradients are cast to ``reduce_dtype``, divided by W (S·R on a HSDP mesh) and
     reduce-scattered through a :class:`~refimpl.sharded.bucketer.ReduceScatterBucketer` into
     this rank's sharded gradient (in the shard's dtype; on a HSDP mesh all-reduced across the
     replicas first, ``refimpl.sharded.hsdp``), and its full gradients and parameters are freed; the
     root unit (and any unit whose inputs need no gradient) at the end of the backward;
  4. the optimizer (``make_optimizer``) steps this rank's chunks; nothing is gathered after
     it — the next forward gathers.

[Note: freeing by storage]
A parameter is freed by resizing its storage to 0 bytes and gathered by resizing it back and
copying in: the ``nn.Parameter`` object, and every tensor autograd saved from it during the
forward, keep pointing at the same storage, so a unit resharded after forward computes its
backward on the values gathered again before it (FSDP1 frees its flat parameter the same way).

[Note: when gradients are reduced]
Per unit, as FSDP2 does: a unit's full gradients live only from its backward to the
reduce-scatter right after it, so the peak holds one unit's gradients, not the model's. A
unit's backward is done when the gradients of its forward inputs are: an identity autograd
function on those inputs (``_PostBackward``) runs after the unit's parameter gradients were
accumulated (autograd runs a parameter's AccumulateGrad as soon as it is ready). A unit
called k times waits for k such calls. Each reduction starts with one all-reduce of "who has
a gradient" over the unit's parameters, so a parameter some rank did not use is reduced with
zeros from that rank and one no rank used keeps its gradient. The root unit, a unit whose
inputs need no gradient, and a gradient that arrives after its unit was reduced are reduced
at the end of the synced backward, in registration order. Per-unit reduction needs every
rank to run every unit's backward (FSDP2 needs the same); units are also all-gathered as
they run, so with rank-dependent control flow keep one root unit (the default).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import _torch_compat as compat
from ..ddp.unused_params import reaches_any
from .bucketer import ReduceScatterBucketer
from .engine import _all_gather_single
from .hsdp import ReplicaReduce
from .optimizer import ShardedOptimizer
from .placement import from_layout, placement_dim, to_layout
from .precision import MixedPrecisionPolicy, cast_floating, keep_local
from .reshard import PostForwardGroup, post_forward_group
from .zero3_reads import ShardReads, _chunk

__all__ = ["FullyShardedDataParallel", "MixedPrecisionPolicy"]


@dataclass
class _Param:
    """One trainable parameter: the module's tensor (freed at rest) and this rank's chunk."""

    name: str
    param: nn.Parameter  # what the module computes with: full while gathered, 0 bytes at rest
    shape: torch.Size
    numel: int
    chunk: int  # elements per rank, padding included: ceil(numel / W)
    offset: int  # start of this rank's chunk in its unit's flat shard of `dtype`
    dtype: torch.dtype  # the parameter's own dtype: shards, optimizer state and full_* reads
    order: int  # registration order in the module: the order gradients are reduced in
    shard: nn.Parameter | None = None  # this rank's chunk: the optimizer's parameter
    acc: Tensor | None = None  # a local no_sync() sum kept in reduce_dtype (refimpl.sharded.precision)
    dim: int = 0  # the dim it is sharded on: values kept in that order (refimpl.sharded.placement)


class _Unit:
    """A module whose parameters are gathered together, with this rank's flat shards."""

    def __init__(self, path: str, module: nn.Module, root: bool) -> None:
        self.path, self.module, self.root = path, module, root
        self.params: list[_Param] = []
        self.flats: dict[torch.dtype, Tensor] = {}  # original dtype -> this rank's chunks end to end
        self.gathered = False
        self.kept: dict[torch.dtype, Tensor] = {}  # reshard_after_forward=k: this rank's row block
        self.pending = 0  # forwards of this backward whose inputs' gradients are still to come
        self.reduced = False  # reduced in this backward ([Note: when gradients are reduced])

    def by_dtype(self) -> dict[torch.dtype, list[_Param]]:
        out: dict[torch.dtype, list[_Param]] = {}
        for p in self.params:
            out.setdefault(p.dtype, []).append(p)
        return out


class FullyShardedDataParallel(ShardReads, nn.Module):
    """ZeRO-3 data parallel on refimpl's reduce-scatter bucketer.

    Usage::

        model = FullyShardedDataParallel(net, units=[blk for blk in net.blocks],
                                         mixed_precision=MixedPrecisionPolicy(torch.bfloat16))
        opt = model.make_optimizer(torch.optim.AdamW, lr=1e-3)   # over this rank's chunks
        loss_fn(model(x), y).backward()     # gathers per unit, reduce-scatters at the end
        opt.step(); opt.zero_grad()
        model.set_requires_gradient_sync(False)   # or `with model.no_sync():`
        loss_fn(model(x1), y1).backward()          # local accumulation in the full p.grad
        model.set_requires_gradient_sync(True)

    Args:
        module: the model; rank 0's parameters and buffers are broadcast at construction.
        process_group: group to shard over (default: the default group).
        replicate_group: HSDP: the ranks holding the same shards as this one (one per shard
            group); gradients are all-reduced across it after each reduce-scatter
            (``refimpl.sharded.hsdp``). None: shard over ``process_group`` only.
        units: submodules gathered as units of their own (the root is always one).
        reshard_after_forward: free a non-root unit's parameters after its forward (and
            gather them again for its backward); False keeps them until the end of backward;
            an int k (a divisor of the world size) keeps 1/k of them and gathers within groups
            of k consecutive ranks before the backward (see ``refimpl.sharded.reshard``).
        mixed_precision: see :class:`MixedPrecisionPolicy`.
        shard_placement_fn: ``fn(param) -> dim`` (or ``Shard(dim)``; None: dim 0) per parameter,
            FSDP2's hook (``refimpl.sharded.placement``).
        bucket_cap_mb: reduce-scatter bucket size, see ``ReduceScatterBucketer``.
        broadcast_buffers: broadcast rank 0's buffers before every forward (DDP's rule).
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, *,
                 replicate_group: dist.ProcessGroup | None = None, units: Iterable[nn.Module] = (), reshard_after_forward: bool | int = True,
                 mixed_precision: MixedPrecisionPolicy | None = None, shard_placement_fn: Callable | None = None,
                 bucket_cap_mb: float = 25,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        assert dist.is_initialized(), (
            "FullyShardedDataParallel needs an initialized process group: call "
            "torch.distributed.init_process_group() first")
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = self.process_group.size()
        self.rank = dist.get_rank(self.process_group)
        self.reshard_after_forward = reshard_after_forward
        # True / False, or the group a unit stays sharded over between its forward and backward
        self._reshard_to = post_forward_group(reshard_after_forward, self.process_group)
        self.mp = mixed_precision or MixedPrecisionPolicy()
        self.broadcast_buffers = broadcast_buffers
        self.bucketer = ReduceScatterBucketer(bucket_cap_mb)
        self._replicas = ReplicaReduce(replicate_group)
        self.dp_size = self.world_size * self._replicas.size  # every share is divided by it
        self._sync = self._sync_backward = True
        self._all_reduce = self._all_reduce_backward = True  # set_requires_all_reduce (HSDP)
        self._end_queued = False

        self._replicas.broadcast(list(module.parameters()), self.process_group)
        self._replicas.broadcast(list(module.buffers()), self.process_group)
        self._placement_fn = shard_placement_fn
        self._units = self._build_units(list(units))
        self._params = [p for u in self._units for p in u.params]
        self._params.sort(key=lambda p: p.order)  # registration order: the reduction order
        self._param_ids = {id(p.param) for p in self._params}
        self._unit_of = {id(q.param): u for u in self._units for q in u.params}
        self._late: list[_Param] = []  # gradients that arrived after their unit was reduced
        for unit in self._units:
            unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
        for p in self._params:
            p.param.register_post_accumulate_grad_hook(functools.partial(self._on_grad_accumulated, p))

    # --- construction -----------------------------------------------------------------------
    def _build_units(self, wrapped: list[nn.Module]) -> list[_Unit]:
        paths = {id(m): path for path, m in self.module.named_modules(remove_duplicate=False)}
        for m in wrapped:
            assert id(m) in paths, f"unit {type(m).__name__} is not a submodule of the wrapped module"
        units = [_Unit("", self.module, root=True)]
        units += [_Unit(paths[id(m)], m, root=False) for m in wrapped if m is not self.module]
        # Every module path that registers each parameter (a shared parameter has several).
        where: dict[int, tuple[str, nn.Parameter, list[str]]] = {}
        for mpath, m in self.module.named_modules(remove_duplicate=False):
            for pname, p in m.named_parameters(recurse=False, remove_duplicate=False):
                if not p.requires_grad:
                    continue
                name = f"{mpath}.{pname}" if mpath else pname
                where.setdefault(id(p), (name, p, []))[2].append(mpath)

        def inside(path: str, unit: _Unit) -> bool:
            return unit.root or path == unit.path or path.startswith(unit.path + ".")

        compute = self.mp.param_dtype
        replaced: dict[int, nn.Parameter] = {}
        initial: dict[int, Tensor] = {}  # id(_Param) -> the full value to shard
        for order, (name, p, mpaths) in enumerate(where.values()):
            assert not p.is_sparse, f"parameter {name!r} is sparse: not supported"
            if p.untyped_storage().nbytes() != p.numel() * p.element_size():
                raise ValueError(f"parameter {name!r} shares its storage with other tensors: FullyShardedDataParallel "
                                 "frees each parameter's storage at rest, so give it storage of its own (p.clone())")
            owner = max((u for u in units if all(inside(mp, u) for mp in mpaths)), key=lambda u: len(u.path))
            chunk = math.ceil(p.numel() / self.world_size)
            offset = sum(q.chunk for q in owner.params if q.dtype == p.dtype)
            entry = _Param(name, p, p.shape, p.numel(), chunk, offset, p.dtype, order,
                           dim=placement_dim(self._placement_fn, p, self.world_size, name))
            initial[id(entry)] = p.detach()  # read once below, before its storage is freed
            if compute is not None and compute != p.dtype:  # the module computes in param_dtype
                replaced[id(p)] = entry.param = nn.Parameter(torch.empty(p.shape, dtype=compute, device=p.device))
            owner.params.append(entry)
        if replaced:
            for m in self.module.modules():
                for pname, p in list(m.named_parameters(recurse=False, remove_duplicate=False)):
                    if id(p) in replaced:
                        setattr(m, pname, replaced[id(p)])  # a leaf Parameter: registered as usual
        with torch.no_grad():
            for unit in units:
                for dtype, group in unit.by_dtype().items():
                    flat = torch.zeros(sum(q.chunk for q in group), dtype=dtype, device=group[0].param.device)
                    unit.flats[dtype] = flat
                    for q in group:
                        view = flat[q.offset:q.offset + q.chunk]
                        view.copy_(_chunk(to_layout(initial.pop(id(q)), q.dim), q.chunk, self.rank, self.world_size))
                        q.shard = nn.Parameter(view)  # shares storage with the unit's flat shard
                        _free(q.param)
        return [u for u in units if u.params or u.root]

    # --- gather / free ----------------------------------------------------------------------
    @torch.no_grad()
    def _gather(self, unit: _Unit) -> None:
        if unit.gathered:
            return
        for dtype, group in unit.by_dtype().items():
            if dtype in unit.kept:  # resharded to a smaller group after forward: gather within it
                rows = self._reshard_to.regather(unit.kept.pop(dtype), _all_gather_single)
            else:
                mine = unit.flats[dtype].to(self.mp.param_dtype or dtype)
                gathered = mine.new_empty(self.world_size * mine.numel())
                _all_gather_single(gathered, mine, group=self.process_group)
                rows = gathered.view(self.world_size, mine.numel())
            for q in group:
                q.param.untyped_storage().resize_(q.numel * q.param.element_size())
                # `.data`: a copy autograd does not count as a change of a tensor it saved
                # ([Note: freeing by storage]); gathering again for backward is not an edit.
                q.param.data.copy_(from_layout(rows[:, q.offset:q.offset + q.chunk].reshape(-1)[:q.numel], q.shape, q.dim))
        unit.gathered = True

    def _free_unit(self, unit: _Unit, keep: bool = False) -> None:
        for q in unit.params:
            _free(q.param)
        unit.gathered = False
        if not keep:
            unit.kept = {}

    def _kept_rows(self, group: list[_Param]) -> Tensor:
        """This rank's row block of the unit's gathered ``(W, n)`` layout, from the gathered
        parameters ([Note: post-forward layout] in ``refimpl.sharded.reshard``)."""
        rows = self._reshard_to.rows()
        W, n = self.world_size, sum(q.chunk for q in group)
        kept = group[0].param.new_zeros((rows.stop - rows.start, n))
        for q in group:
            padded = q.param.new_zeros(q.chunk * W)
            padded[:q.numel] = to_layout(q.param.detach(), q.dim)
            kept[:, q.offset:q.offset + q.chunk] = padded.view(W, q.chunk)[rows]
        return kept.reshape(-1)

    def _pre_forward(self, unit: _Unit, module, args):
        if unit.root:
            if self.broadcast_buffers and self.dp_size > 1:
                self._replicas.broadcast(list(self.module.buffers()), self.process_group)
            self._sync_backward, self._all_reduce_backward = self._sync, self._all_reduce
        self._gather(unit)
        if unit.root or not (self._sync and torch.is_grad_enabled()):
            return None
        wanted = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
        if not wanted:
            return None  # no input gradient to wait for: reduced at the end of backward
        unit.pending += 1
        passed = _PostBackward.apply(functools.partial(self._post_backward, unit), *(args[i] for i in wanted))
        out = list(args)
        for i, t in zip(wanted, passed, strict=True):
            out[i] = t
        return tuple(out)

    def _post_forward(self, unit: _Unit, module, args, output):
        if unit.root:
            if not torch.is_grad_enabled():
                self._free_all()
            elif not reaches_any(output, self._param_ids):
                # This rank's backward fires no gradient hook, yet the other ranks expect its
                # share of every collective (pytorch/pytorch#40566): reduce now, same order;
                # and free now, inside no_sync() too, so the next forward gathers everywhere.
                self._end_of_backward()
            return output
        if self._reshard_to is not False:
            keep = isinstance(self._reshard_to, PostForwardGroup) and torch.is_grad_enabled()
            if keep:
                with torch.no_grad():
                    unit.kept = {dtype: self._kept_rows(group) for dtype, group in unit.by_dtype().items()}
            self._free_unit(unit, keep=keep)
            if torch.is_grad_enabled():
                tensors = [t for t in _tensors(output) if t.requires_grad]
                if tensors:  # gather again before this unit's backward runs
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, functools.partial(self._pre_backward, unit), mode="any")
        return output

    def _pre_backward(self, unit: _Unit, grad) -> None:
        self._queue_end()
        self._gather(unit)

    def _free_all(self) -> None:
        for unit in self._units:
            self._free_unit(unit)

    # --- no_sync ----------------------------------------------------------------------------
    def set_requires_gradient_sync(self, requires: bool) -> None:
        """False: backward accumulates the local full ``p.grad`` (FSDP2's name for no_sync)."""
        self._sync = bool(requires)

    def set_requires_all_reduce(self, requires: bool) -> None:
        """HSDP: False reduce-scatters each synced backward inside the shard group and keeps the
        chunk, all-reducing across replicas only at the next backward with True (FSDP2's name)."""
        self._all_reduce = bool(requires)

    @contextlib.contextmanager
    def no_all_reduce(self) -> Iterator[None]:
        """``set_requires_all_reduce(False)`` for the backwards of the forwards inside."""
        previous, self._all_reduce = self._all_reduce, False
        try:
            yield
        finally:
            self._all_reduce = previous

    def clear_local_gradients(self) -> None:
        """Drop local no_sync() sums kept in reduce_dtype (``ShardedOptimizer.zero_grad``)."""
        for q in self._params:
            q.acc = None

    @property
    def require_backward_grad_sync(self) -> bool:
        return self._sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def forward(self, *args, **kwargs):
        if self.mp.param_dtype is not None:  # floating inputs in the compute dtype, as FSDP2 casts them
            args, kwargs = cast_floating((args, kwargs), self.mp.param_dtype)
        return self.module(*args, **kwargs)

    # --- gradient reduction -----------------------------------------------------------------
    def _on_grad_accumulated(self, q: _Param, param: Tensor) -> None:
        self._queue_end()
        q.acc = keep_local(q.acc, param, self.mp.reduce_dtype, self._sync_backward)  # [Note: accumulating in reduce_dtype]
        if self._unit_of[id(q.param)].reduced:
            self._late.append(q)  # its unit was reduced already: reduce this one at the end

    @torch.no_grad()
    def _post_backward(self, unit: _Unit) -> None:
        """Every forward of ``unit`` in this backward has its input gradients: reduce and free it."""
        self._queue_end()
        unit.pending -= 1
        if unit.pending > 0 or unit.reduced or not self._sync_backward:
            return
        self._reduce(sorted(unit.params, key=lambda q: q.order))
        unit.reduced = True
        self._free_unit(unit)

    def _queue_end(self) -> None:
        if not self._end_queued:
            self._end_queued = True
            compat.queue_backward_callback(self._end_of_backward)

    @torch.no_grad()
    def _end_of_backward(self) -> None:
        self._end_queued = False
        self._free_all()  # parameters first: the reduction needs only the gradients (lower peak)
        late, self._late = self._late, []
        if self._sync_backward:
            rest = [q for q in self._params if not self._unit_of[id(q.param)].reduced]
            self._reduce(rest + [q for q in late if q.param.grad is not None or q.acc is not None])
            if self._all_reduce_backward:  # partials no chunk of this backward met (refimpl.sharded.hsdp)
                self._replicas.finish(True, _accumulate, rest=True)
            self.bucketer.teardown()
            for q in self._params:
                q.param.grad = None
        for unit in self._units:
            unit.pending, unit.reduced = 0, False

    def _reduce(self, params: list[_Param]) -> None:
        """Reduce-scatter ``params``' full gradients into their shards (same calls on every rank)."""
        device = self._params[0].param.device if self._params else torch.device("cpu")
        used = torch.tensor([q.param.grad is not None or q.acc is not None for q in params], dtype=torch.int32,
                            device=device)
        dist.all_reduce(used, group=self.process_group)
        self._replicas.count_users(used)  # HSDP: used on any replica
        for q, n_ranks in zip(params, used.tolist(), strict=True):
            if n_ranks == 0:
                continue  # no rank used it: its sharded gradient stays as it was
            self.bucketer.reduce_scatter_async(self._chunks_to_reduce(q, device), self.process_group,
                                               functools.partial(self._replicas.collect, q, accumulate=_accumulate))
            q.param.grad = q.acc = None  # the bucketer copied what it needs
        self.bucketer.flush()
        self._replicas.finish(self._all_reduce_backward, _accumulate)  # HSDP: across replicas, or kept

    def _chunks_to_reduce(self, q: _Param, device: torch.device) -> list[Tensor]:
        """The W chunks of ``grad / dp_size`` in the reduce dtype: views of the gradient where a chunk
        is all real elements, a zero-padded copy only for the chunk that holds the end."""
        W, grad = self.world_size, q.acc if q.acc is not None else q.param.grad
        rdtype = self.mp.reduce_dtype or (grad.dtype if grad is not None else q.param.dtype)
        if grad is None:  # another rank used it: this rank's share is zero
            return list(torch.zeros(W, q.chunk, dtype=rdtype, device=device))
        # In place: the gradient is dropped right after (as DDP divides its bucket views in place).
        flat = to_layout(grad, q.dim).to(rdtype).div_(self.dp_size)
        full = q.numel // q.chunk if q.chunk else W
        chunks = list(flat[:full * q.chunk].view(full, q.chunk))
        if full < W:
            tail = flat.new_zeros((W - full) * q.chunk)
            tail[:q.numel - full * q.chunk] = flat[full * q.chunk:]
            chunks += list(tail.view(W - full, q.chunk))
        return chunks

    # --- optimizer support ------------------------------------------------------------------
    def sharded_parameters(self) -> list[nn.Parameter]:
        """This rank's chunks, one ``nn.Parameter`` per trainable parameter (for optimizers)."""
        return [q.shard for q in self._params if q.chunk > 0]

    def make_optimizer(self, optimizer_class: Callable[..., torch.optim.Optimizer], **kwargs) -> ShardedOptimizer:
        """An optimizer over this rank's chunks (its state is sharded too)."""
        return ShardedOptimizer(self, optimizer_class, **kwargs)

    def gather_parameters(self) -> None:
        """Nothing to do after a step: the shards are the parameters; the next forward gathers."""

    def _assert_idle(self, what: str) -> None:
        assert not self._end_queued, f"{what} during backward: call it after loss.backward() has returned"


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs once their gradients are all
    computed, after the unit's own parameter gradients ([Note: when gradients are reduced])."""

    @staticmethod
    def forward(ctx, hook, *inputs):
        ctx.hook = hook
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


def _free(param: Tensor) -> None:
    param.untyped_storage().resize_(0)


def _accumulate(q: _Param, reduced: Tensor) -> None:
    """Bucketer callback: add the reduced chunk (cast to the shard's dtype) to the sharded gradient."""
    reduced = reduced.to(q.shard.dtype)
    if q.shard.grad is None:
        q.shard.grad = reduced  # a view of this flush's own output (the bucketer never reuses it)
    else:
        q.shard.grad.add_(reduced)


def _tensors(output) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []

