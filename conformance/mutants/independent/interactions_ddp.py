"""Interaction bugs in DDP engines (issue 38), written from the contracts and user docs alone.

Why this zoo: the catalogue turns one feature on against a default background, so a bug that
needs two things at once — two features, an option in its non-default state, a value regime,
or the order a user writes calls in — can pass every scenario. Each mutant here is refimpl's
`DistributedDataParallel`, correct everywhere except where its two things meet; the docstring
names the pair and the wrong value. Written from `docs/contracts/ddp.md`, the user guide, the
adapter protocol and refimpl's public API, without reading the scenario catalogue, so the
catch rate says what a new bug of this kind would meet.

A mutant counts `mutation_fired` (read through `backward_stats()`) only where its bug changed
what the correct engine would have computed. Where the bug sits in a collective, the mutant
also runs the correct collective and compares bit for bit, so "fired" means "a different
value", not "the code path ran". Run::

    gradparity zoo --area ddp --set interactions --profile standard
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from conformance.mutants.independent import ddp as independent_ddp
from conformance.mutants.independent.ddp import (  # the same plumbing as the independent DDP zoo
    Engine,
    MutantReducer,
)
from conformance.mutants.registry import Registry
from refimpl.ddp import comm_hooks as hooks
from refimpl.ddp.reducer import Reducer, ReducerState

MUTANTS = Registry("ix-ddp")
FP16 = torch.float16


class Correct(independent_ddp.Correct):
    """`refimpl-ddp` around `engine_class`: the control these mutants are judged against (the
    independent DDP zoo's control, named for this zoo)."""

    name_prefix = "ix-ddp"
    pair = ""


def mutant(name: str, clause: str, pair: str, bug: str, **kw):
    """Register an Engine subclass as mutant `name`, inside a `Correct` adapter."""
    def adapter(engine_cls):
        return type(f"{engine_cls.__name__}Adapter", (Correct,),
                    {"engine_class": engine_cls, "name_suffix": name})
    return MUTANTS.interaction(name, clause, pair, bug, adapter=adapter, **kw)


# -- helpers: a comm hook computed synchronously, the correct value beside it ------------------------
def _done(t: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(t)
    return fut


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bit pattern (so inf, nan and -0.0 compare as values do not)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _compressed(buffer: torch.Tensor, dtype, group) -> torch.Tensor:
    """refimpl's (and torch's) compress hook, synchronously: cast, divide by W, sum."""
    low = buffer.to(dtype).div_(group.size())
    dist.all_reduce(low, group=group)
    return low


def _group(state):
    return state if state is not None else dist.group.WORLD


def _send_wrong(engine, buf: torch.Tensor, right: torch.Tensor, wrong: torch.Tensor) -> torch.futures.Future:
    """The bucket takes the mutant's `wrong` sum; fired once per element whose bits differ from `right`."""
    engine._fired(int((_bits(right) != _bits(wrong)).sum()))
    buf.copy_(wrong)
    return _done(buf)


class _HookEngine(Engine):
    """Replaces refimpl's fp16 hook by the subclass's `_hook16(state, bucket)` when the user registers it."""

    def register_comm_hook(self, state, hook) -> None:
        if hook is hooks.fp16_compress_hook:
            hook = self._hook16
        super().register_comm_hook(state, hook)


# -- value regimes ------------------------------------------------------------------------------------
@mutant("fp16-hook-saturates", "D12", "fp16 comm hook x large magnitudes",
        "the fp16 hook clamps to +-65504 before the cast: a gradient past fp16's range becomes 65504/W "
        "where torch's cast gives inf (and a GradScaler would skip the step)")
class Fp16HookSaturates(_HookEngine):
    def _hook16(self, state, bucket):
        group, buf = _group(state), bucket.buffer()
        limit = torch.finfo(FP16).max
        self._fired(int((torch.isinf(buf.to(FP16)) & torch.isfinite(buf)).sum()))
        buf.copy_(_compressed(buf.clamp(-limit, limit), FP16, group))
        return _done(buf)


@mutant("fp16-hook-flushes-subnormals", "D12", "fp16 comm hook x tiny values",
        "the fp16 hook flushes fp16 subnormals (|x| < 2**-14) to zero before and after the sum: "
        "tiny gradients vanish where torch's cast keeps them")
class Fp16HookFlushesSubnormals(_HookEngine):
    def _hook16(self, state, bucket):
        group, buf = _group(state), bucket.buffer()
        tiny = torch.finfo(FP16).tiny
        low = buf.to(FP16).div_(group.size())
        sub = (low != 0) & (low.abs() < tiny)
        low[sub] = 0
        dist.all_reduce(low, group=group)
        sub_out = (low != 0) & (low.abs() < tiny)
        low[sub_out] = 0
        self._fired(int(sub.sum()) + int(sub_out.sum()))
        buf.copy_(low)
        return _done(buf)


@mutant("half-params-skip-compression", "D12", "fp16 comm hook x bf16 parameters",
        "the fp16 hook sends a bucket that is already 16-bit (bf16) as it is: the sum runs in bf16, "
        "not in fp16 (torch casts to fp16), so it rounds, overflows and underflows differently")
class HalfParamsSkipCompression(_HookEngine):
    def _hook16(self, state, bucket):
        group, buf = _group(state), bucket.buffer()
        if buf.dtype not in (torch.bfloat16,):
            buf.copy_(_compressed(buf, FP16, group))
            return _done(buf)
        right = _compressed(buf, FP16, group).to(buf.dtype)
        wrong = buf.clone().div_(group.size())
        dist.all_reduce(wrong, group=group)
        return _send_wrong(self, buf, right, wrong)


class _SumFirstEngine(Engine):
    def _build_reducer(self) -> Reducer:
        reducer = super()._build_reducer()
        if reducer._hook is not None:  # mixed_precision=reduce_dtype installed its hook
            dtype = self.mixed_precision.reduce_dtype
            reducer._hook = lambda state, bucket: self._sum_then_divide(dtype, state, bucket)
        return reducer

    def _sum_then_divide(self, dtype, state, bucket):
        group, buf = _group(state), bucket.buffer()
        right = _compressed(buf, dtype, group)
        wrong = buf.to(dtype)
        dist.all_reduce(wrong, group=group)
        return _send_wrong(self, buf, right, wrong.div_(group.size()))


@mutant("reduce-dtype-sums-before-divide", "D2", "mixed_precision reduce_dtype=fp16 x large magnitudes",
        "with reduce_dtype fp16 the undivided shares are summed and the sum divided: it overflows to inf "
        "where dividing each share first stays finite (and rounds differently at W=3)")
class ReduceDtypeSumsBeforeDivide(_SumFirstEngine):
    pass


@mutant("reduce-dtype-accumulates-low", "D3", "mixed_precision reduce_dtype x no_sync (continuous values)",
        "inside no_sync() each micro-batch's local sum is rounded to reduce_dtype: the accumulation "
        "loses bits a single cast at the synced reduction keeps (exact on small integers)")
class ReduceDtypeAccumulatesLow(Engine):
    def __init__(self, module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        dtype = getattr(self.mixed_precision, "reduce_dtype", None)
        if dtype is not None:
            for p in self.module.parameters():
                if p.requires_grad and p.dtype != dtype:
                    p.register_post_accumulate_grad_hook(lambda p, d=dtype: self._round(p, d))

    def _round(self, p, dtype) -> None:
        if self.reducer.state is not ReducerState.IDLE or p.grad is None or p.grad.is_sparse:
            return  # a synced backward: the reducer casts once, correctly
        rounded = p.grad.to(dtype).to(p.grad.dtype)
        self._fired(int((rounded != p.grad).sum()))
        p.grad.copy_(rounded)


# -- options in their non-default state ---------------------------------------------------------------
class _BufferWatch(Engine):
    """Counts a buffer broadcast that changed this rank's buffers where torch would not broadcast."""

    def _torch_would_broadcast(self) -> bool:
        return super()._sync_buffers_this_forward()

    def _broadcast_buffers(self, active: bool) -> None:
        expected = self._torch_would_broadcast()
        before = [b.detach().clone() for b in self._buffers_to_sync]
        super()._broadcast_buffers(active)
        if not expected:
            self._fired(any(not torch.equal(a, b) for a, b in zip(before, self._buffers_to_sync, strict=True)))


@mutant("broadcast-buffers-off-ignored", "D6", "broadcast_buffers=False x buffers that differ across ranks",
        "broadcast_buffers=False is read only at construction: rank 0's buffers still overwrite every "
        "rank's before each forward, so a rank's own running statistics are lost")
class BroadcastBuffersOffIgnored(_BufferWatch):
    def _sync_buffers_this_forward(self) -> bool:
        return bool(self.require_forward_param_sync and self._buffers_to_sync)


@mutant("buffers-broadcast-after-no-sync", "D6", "buffers x no_sync",
        "rank 0's buffers are broadcast before every forward, also the forwards after a no_sync() forward "
        "where torch skips it (require_forward_param_sync): buffers updated inside the accumulation are overwritten")
class BuffersBroadcastAfterNoSync(_BufferWatch):
    def _sync_buffers_this_forward(self) -> bool:
        return bool(self.forward_sync_buffers and self._buffers_to_sync)


class _LocalStaticMap(MutantReducer):
    def _mark_the_rest_ready(self):
        graph = self._static
        if graph is None or not graph.learning:
            return super()._mark_the_rest_ready()
        global_used = super()._mark_the_rest_ready()  # all-reduced; the bug keeps the local map
        local = [int(u > 0) for u in self._used]
        self._fired(sum(int(g > 0) != u for g, u in zip(global_used, local, strict=True)))
        graph.global_used = local
        return local


@mutant("static-graph-local-used-map", "D4", "static_graph x a parameter used on some ranks only",
        "with static_graph the first backward's used map is this rank's own, not the all-reduced one: "
        "a rank that did not use a parameter keeps its old .grad (None) while the others take the average")
class StaticGraphLocalUsedMap(Engine):
    _reducer_class = _LocalStaticMap


@mutant("join-divisor-cached", "D10", "join(divide_by_initial_world_size=False) x ranks joining over time",
        "the active-rank divisor is taken at the first iteration and kept: after a rank joins, the "
        "survivors still divide by the old count (the sum over fewer ranks is divided by too many)")
class JoinDivisorCached(Engine):
    def _join_pre_forward(self, sync: bool) -> None:
        super()._join_pre_forward(sync)
        if not sync or self._divide_by_initial_world_size:
            return
        first = self.__dict__.setdefault("_first_divisor", self.reducer._div)
        self._fired(first != self.reducer._div)
        self.reducer._div = first


class _SparseKeepsLocal(MutantReducer):
    def _finalize(self) -> None:
        sparse = [self._params[i] for b in self._buckets if b.sparse for i in b.plan.param_indices]
        unused_here = [p for p in sparse if p.grad is None]
        super()._finalize()
        for p in unused_here:
            if p.grad is not None:  # the others used it: the average arrived, and is dropped here
                p.grad = None
                self._fired()


@mutant("sparse-unused-keeps-none", "D8", "sparse gradients x find_unused_parameters x a rank not using the embedding",
        "a rank whose forward did not touch a sparse embedding keeps grad None after the reduction, "
        "while the ranks that used it hold the average: the ranks' models diverge at the next step")
class SparseUnusedKeepsNone(Engine):
    _reducer_class = _SparseKeepsLocal


# -- the order a user writes calls in -----------------------------------------------------------------
@mutant("params-replaced-at-wrap", "D11", "order: the optimizer built before wrapping x its step",
        "the engine re-registers every parameter as a fresh nn.Parameter at construction: an optimizer "
        "built over module.parameters() before wrapping steps orphans, and the model never moves")
class ParamsReplacedAtWrap(Engine):
    def __init__(self, module, *args, **kwargs):
        fresh: dict[int, nn.Parameter] = {}
        old: dict[int, nn.Parameter] = {}
        for mod in module.modules():
            for name, p in list(mod.named_parameters(recurse=False, remove_duplicate=False)):
                if id(p) not in fresh:  # tied weights stay tied
                    fresh[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                    old[id(p)] = p
                setattr(mod, name, fresh[id(p)])  # a Parameter assigned re-registers it
        super().__init__(module, *args, **kwargs)
        # weak references only: an old parameter still alive is held by someone else (an optimizer)
        self.__dict__["_orphans"] = [weakref.ref(p) for p in old.values()]

    def forward(self, *inputs, **kwargs):
        self._fired(sum(r() is not None for r in self._orphans))
        return super().forward(*inputs, **kwargs)


def correct() -> Correct:
    return Correct()


globals().update(MUTANTS.factories())
