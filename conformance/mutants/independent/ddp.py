"""Independent known-bad DDP engines (issue 30), from `docs/contracts/ddp.md` and `DESIGN.md` alone.

`Engine` is refimpl's `DistributedDataParallel` plus a fired count; each mutant changes one
method of the wrapper, of its reducer (`_reducer_class`: the reducer the wrapper builds is given
that class) or of its join hook, the way a person writing that piece could. The adapters are the
built-in `refimpl-ddp` adapter around the mutant class (`DDPLikeAdapter`, refimpl's comm hooks
and torch DDP's semantics), so a mutant runs every scenario refimpl's DDP runs.

Dimensions (see the package docstring): `who` (rank 0, the highest rank), `when` (a flag read at
forward or at backward, buffers before or after the forward, the used map reset), `how often`
(the unused set computed once, a second synced backward without zero_grad), `inputs` (outputs
in a dict, keyword arguments in no_sync), `ambient` (autocast in a thread, the default dtype),
`end of life` (the model every rank keeps when join ends).
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist

from conformance.adapters.ddp_like import DDPLikeAdapter
from conformance.mutants.firing import Fires
from conformance.mutants.registry import Registry
from refimpl.broadcast import broadcast_from_rank0
from refimpl.ddp import DistributedDataParallel
from refimpl.ddp.comm_hooks import GradBucket
from refimpl.ddp.join import DDPJoinHook, find_common_rank
from refimpl.ddp.reducer import Reducer, ReducerState
from refimpl.nested import find_tensors

MUTANTS = Registry("indep-ddp")


class Engine(Fires, DistributedDataParallel):
    """refimpl's DDP; `_reducer_class` (a `Reducer` subclass) replaces the reducer's class."""

    _reducer_class: type | None = None

    def __init__(self, module, *args, **kwargs):
        self.__dict__["mutation_fired"] = 0  # before nn.Module's __init__ (a plain attribute)
        super().__init__(module, *args, **kwargs)

    def _build_reducer(self) -> Reducer:
        reducer = super()._build_reducer()
        if self._reducer_class is not None:
            reducer.__class__ = self._reducer_class  # same state, one method changed
            reducer.engine = weakref.ref(self)
            reducer.adopted()
        return reducer

    def backward_stats(self) -> dict:
        """What the zoo reads (`mutation_fired`), beside refimpl's bucket timeline."""
        return {**self.get_backward_stats().as_dict(), "mutation_fired": self.mutation_fired}


class MutantReducer(Reducer):
    """A reducer that knows its engine (for the fired count and the wrapper's flags)."""

    engine = None

    def adopted(self) -> None:
        """Called once the reducer has become this class (after its constructor ran)."""

    def _fired(self, n: int | bool = 1) -> None:  # forwarded to the engine, which counts
        engine = self.engine() if self.engine is not None else None
        if engine is not None:
            engine._fired(n)


class Correct(DDPLikeAdapter):
    """`refimpl-ddp` around `engine_class`: the control the mutants here are judged against."""

    engine_class = Engine
    bug, clause, may_abort, dimension = "", "", False, ""

    def __init__(self):
        import refimpl
        from refimpl.ddp import comm_hooks

        def hooks():
            return {"allreduce": comm_hooks.allreduce_hook, "fp16": comm_hooks.fp16_compress_hook,
                    "bf16": comm_hooks.bf16_compress_hook}

        super().__init__(f"{self.name_prefix}-{self.name_suffix}", self.engine_class, version=refimpl.__version__,
                         comm_hooks=hooks)
        self.deterministic = True  # as refimpl-ddp: same inputs, same collectives in the same order
        # no declared semantics: refimpl divides each share before the sum, as torch DDP does

    name_prefix, name_suffix = "indep-ddp", "correct"  # the adapter's name: indep-ddp-<mutant>


def mutant(name: str, clause: str, dimension: str, bug: str, **kw):
    """Register an Engine subclass as mutant `name`, wrapped in an adapter class."""
    def adapter(engine_cls):
        return type(f"{engine_cls.__name__}Adapter", (Correct,),
                    {"engine_class": engine_cls, "dimension": dimension, "name_suffix": name})
    return MUTANTS.mutant(name, clause, f"[{dimension}] {bug}", adapter=adapter, **kw)


# -- when ------------------------------------------------------------------------------------------
class _FlagAtBackward(MutantReducer):
    def _output_prehook(self, grad_outputs):
        engine = self.engine()
        if self._state is ReducerState.PREPARED and engine is not None:
            now, then = engine.require_backward_grad_sync, engine._flag_at_forward
            self._fired(now != then)
            if not now:  # inside no_sync() now: only accumulate (whatever the forward said)
                self._state = ReducerState.IDLE
                return
        super()._output_prehook(grad_outputs)


@mutant("sync-flag-read-at-backward", "D3", "when", may_abort=True,
        bug="whether a backward reduces is read from no_sync() when the backward starts, not captured at the "
            "forward: a forward inside no_sync() whose backward runs outside it is reduced, and the reverse is not")
class SyncFlagReadAtBackward(Engine):
    _reducer_class = _FlagAtBackward
    _flag_at_forward = True

    def _pre_forward(self):
        flag = self._flag_at_forward = self.require_backward_grad_sync
        self.require_backward_grad_sync = True  # prepare every forward; backward decides
        try:
            return super()._pre_forward()
        finally:
            self.require_backward_grad_sync = flag

    def _post_forward(self, output, sync):
        super()._post_forward(output, sync)
        if not self._flag_at_forward:
            self.require_forward_param_sync = False  # the buffer rule still sees the no_sync forward


@mutant("buffers-broadcast-after-forward", "D6", "when", may_abort=True,
        bug="rank 0's buffers are broadcast after the forward instead of before it: the forward runs on each "
            "rank's own buffers, rank 0's update of this forward overwrites the others' (and a buffer the backward "
            "needs is changed in place: autograd raises)")
class BuffersBroadcastAfterForward(Engine):
    def _pre_forward(self):
        self._late = self._sync_buffers_this_forward()
        keep, self.forward_sync_buffers = self.forward_sync_buffers, False
        try:
            return super()._pre_forward()
        finally:
            self.forward_sync_buffers = keep

    def _post_forward(self, output, sync):
        super()._post_forward(output, sync)
        if self._late:
            self._fired(self.world_size > 1)
            self._broadcast_buffers(active=True)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)


class _UsedMapResetAtForward(MutantReducer):
    def prepare_for_backward(self, outputs=()):
        self._fired(self._find_unused and any(self._used))
        self._used = [0] * len(self._params)  # forgets what no_sync micro-batches used
        super().prepare_for_backward(outputs)


@mutant("used-map-reset-at-forward", "D4", "when",
        "the used map (which parameters got a gradient) is reset at every synced forward, not at the end of the "
        "synced backward: a parameter used only in no_sync() micro-batches counts as used by no rank and keeps "
        "its local, unaveraged gradient")
class UsedMapResetAtForward(Engine):
    _reducer_class = _UsedMapResetAtForward


# -- who -------------------------------------------------------------------------------------------
@mutant("buffers-from-highest-rank", "D6", "who",
        "buffers are broadcast before each forward from the highest rank (join's rule for the authoritative "
        "rank, applied without join) instead of rank 0")
class BuffersFromHighestRank(Engine):
    def _broadcast_buffers(self, active):
        if self._join_config.enable:
            return super()._broadcast_buffers(active)
        group = self.process_group
        mine = [b.detach().clone() for b in self._buffers_to_sync]
        src = find_common_rank(dist.get_rank(group), True, group, self.join_device)
        broadcast_from_rank0(self._buffers_to_sync, group, src)
        broadcast_from_rank0(mine, group, 0)  # what rank 0 would have sent: fired where it differs
        self._fired(any(not torch.equal(a, b) for a, b in zip(mine, self._buffers_to_sync, strict=True)))


class _Rank0JoinHook(DDPJoinHook):
    def post_hook(self, is_last_joiner):
        ddp = self.ddp
        group = ddp.process_group
        src = find_common_rank(dist.get_rank(group), is_last_joiner, group, ddp.join_device)
        ddp._fired(src != 0)
        ddp._sync_module_states(0)


# -- end of life -----------------------------------------------------------------------------------
@mutant("join-final-model-from-rank0", "D10", "end of life",
        "when join() ends every rank takes rank 0's model (the construction rule) instead of the model of the "
        "last rank to run out of data: a rank 0 that ran out first hands everyone its stale parameters")
class JoinFinalModelFromRank0(Engine):
    def join_hook(self, **kwargs):
        return _Rank0JoinHook(self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True))


# -- how often -------------------------------------------------------------------------------------
class _UnusedSetCached(MutantReducer):
    _cached: list[int] | None = None

    def prepare_for_backward(self, outputs=()):
        super().prepare_for_backward(outputs)
        if not self._find_unused or self._static is not None:
            return
        if self._cached is None:
            self._cached = list(self._unused_at_start)
            return
        self._fired(bool(set(self._cached) - set(self._unused_at_start)))  # reachable now, marked ready early
        self._unused_at_start = list(self._cached)


@mutant("unused-set-cached", "D4", "how often", may_abort=True,
        bug="with find_unused_parameters the graph walk runs at the first synced forward only and its unused set "
            "is reused: a parameter unused then but used later is marked ready early (an error), one used then "
            "but unused later is waited for")
class UnusedSetCached(Engine):
    _reducer_class = _UnusedSetCached


class _BucketZeroedAtForward(MutantReducer):
    def prepare_for_backward(self, outputs=()):
        if self._as_view:
            for b in self._buckets:
                if b.sparse:
                    continue
                held = any(p.grad is not None and p.grad.data_ptr() == v.data_ptr() for p, v in zip(b.params, b.views, strict=True))
                self._fired(held and bool(b.buffer.any()))
                b.buffer.zero_()  # a fresh sum for this iteration ... which is also the user's .grad
        super().prepare_for_backward(outputs)


@mutant("bucket-view-zeroed-at-forward", "D11", "how often",
        "bucket buffers are zeroed at every synced forward for a fresh sum, but with gradient_as_bucket_view the "
        "buffers are the .grad tensors: a second synced backward without zero_grad() loses the first one's "
        "gradient (and a no_sync accumulation after a zero_grad(set_to_none=False) is wiped)")
class BucketViewZeroedAtForward(Engine):
    _reducer_class = _BucketZeroedAtForward


# -- inputs ----------------------------------------------------------------------------------------
def _tensors_outside_mappings(obj):
    """The output walk with the slip: tensors, tuples and lists; a mapping's values are not visited."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors_outside_mappings(v)


@mutant("dict-outputs-unwalked", "D4", "inputs",
        "the find_unused_parameters graph walk visits tensors in tuples and lists but not in dicts: a forward "
        "returning a dict looks as if it used no parameter, so its buckets are reduced (zeros) before backward")
class DictOutputsUnwalked(Engine):
    def _post_forward(self, output, sync):
        if not (sync and self.find_unused_parameters and not self.static_graph):
            return super()._post_forward(output, sync)
        walked = list(_tensors_outside_mappings(output))
        self._fired(len(walked) != len(list(find_tensors(output))))
        self.require_forward_param_sync = True
        self.reducer.prepare_for_backward(walked)
        self.reducer.attach_to_outputs(walked)


@mutant("no-sync-drops-kwargs", "D3", "inputs",
        "the forward's no_sync() path (no reducer preparation) calls module(*inputs) without the keyword "
        "arguments: inside no_sync() a model sees its keywords' defaults")
class NoSyncDropsKwargs(Engine):
    def forward(self, *inputs, **kwargs):
        if self.require_backward_grad_sync or not torch.is_grad_enabled():
            return super().forward(*inputs, **kwargs)
        sync = self._pre_forward()
        self._fired(bool(kwargs))
        output = self.module(*inputs)
        self._post_forward(output, sync)
        return output


# -- ambient ---------------------------------------------------------------------------------------
def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


@mutant("forward-thread-drops-autocast", "D13", "ambient",
        "the module's forward runs on a helper thread the engine starts (to overlap it with its own "
        "bookkeeping), which carries grad mode over but not autocast: under torch.autocast the forward runs "
        "in full precision")
class ForwardThreadDropsAutocast(Engine):
    def forward(self, *inputs, **kwargs):
        sync = self._pre_forward()
        grad_mode, box = torch.is_grad_enabled(), {}
        self._fired(_autocast_on())

        def run():
            try:
                with torch.set_grad_enabled(grad_mode):
                    box["out"] = self.module(*inputs, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                box["error"] = exc

        worker = threading.Thread(target=run, name="indep-ddp-forward")
        worker.start()
        worker.join()
        if "error" in box:
            raise box["error"]
        self._post_forward(box["out"], sync)
        return box["out"]


class _DefaultDtypeBuckets(MutantReducer):
    def adopted(self):
        self._default_dtype_buffers()

    def _install(self, plans):
        super()._install(plans)
        if self.engine is not None:
            self._default_dtype_buffers()

    def _default_dtype_buffers(self) -> None:
        for b in self._buckets:
            if b.sparse or b.buffer.dtype == torch.get_default_dtype():
                continue
            self._fired()
            plan = b.plan
            b.buffer = torch.zeros(plan.numel, device=plan.device)  # the slip: no dtype=
            b.views = [b.buffer.narrow(0, off, n).view(shape)
                       for off, n, shape in zip(plan.offsets, plan.lengths, plan.shapes, strict=True)]
            b.grad_bucket = GradBucket(plan.index, b.buffer, b.params, b.views, plan.index == len(self._buckets) - 1)


@mutant("bucket-default-dtype", "D9", "ambient",
        "bucket buffers are allocated with the default dtype (torch.zeros without dtype=): fp64 and fp16 "
        "gradients are reduced in float32")
class BucketDefaultDtype(Engine):
    _reducer_class = _DefaultDtypeBuckets


def correct() -> Correct:
    return Correct()


globals().update(MUTANTS.factories())
