"""The reducer: executes a bucket plan during backward.

Lifecycle of one synced iteration (see ``ReducerState``)::

    IDLE --prepare_for_backward()--> PREPARED --first grad hook--> BACKWARD
         <------------------- finalize (queued autograd callback) --------

* ``prepare_for_backward`` (called by DDP after a synced forward) resets the per-iteration
  tables and, with ``find_unused_parameters``, walks the autograd graph from the forward
  outputs to learn which parameters cannot receive a gradient.
* Each parameter's post-accumulate-grad hook copies ``p.grad`` into its slot of a flat
  bucket buffer (or finds it already there with ``gradient_as_bucket_view``). When a bucket's
  last slot is filled, that bucket and every ready bucket after it are launched as
  asynchronous all-reduces -- strictly in bucket order, so all ranks issue the same
  collectives in the same order whatever order their gradients arrive in.
* The first hook of a backward queues ``_finalize`` on the autograd engine; it runs when
  backward ends, marks parameters that never got a gradient (or raises if that is not
  allowed), waits for every bucket and writes the averages back to ``.grad``.

[Note: why finalize raises] PyTorch queues its finalizer only once every bucket is launched,
so a parameter that never gets a gradient is only reported at the *next* forward, after an
optimizer step on unsynchronised gradients (pytorch/pytorch#128949). Queuing at the first
hook lets us raise at the end of the very backward that went wrong.

[Note: the used map] ``_used`` records which parameters got a gradient on this rank since
the last synced backward, *including* ``no_sync`` micro-batches (pytorch/pytorch#69031). It
is all-reduced with find_unused_parameters so a parameter no rank used keeps its ``.grad``
untouched (``None`` stays ``None``), while one used by some ranks gets the average with zero
contributions from the others.

[Note: a rank that uses no parameter] With find_unused_parameters, a rank whose forward
reaches no parameter at all gets no gradient hook in its backward, so nothing would ever
launch its buckets and the other ranks would wait forever or mismatch collectives
(pytorch/pytorch#40566). The graph walk tells us this at the end of forward, so the reducer
contributes zeros for every bucket right there, in bucket order, and finalizes.

[Note: finalize on the outer backward] The finalize callback is queued on the graph task
that is running when it is queued. A reentrant backward (``torch.utils.checkpoint`` with
``use_reentrant=True``) runs each checkpointed segment's backward as a graph task of its
own, so a callback queued by the first gradient hook would run when the first *segment*
ends. ``attach_to_outputs`` therefore registers a pre-hook on the forward outputs'
autograd nodes: it runs first, in the outer graph task, and queues finalize there. The
gradient hooks only fall back to queuing it when backward did not start from an output.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from enum import Enum

import torch
import torch.distributed as dist

from .buckets import FUSE_MIN_NUMEL, Bucket
from .plan import (
    DEFAULT_BUCKET_CAP_BYTES,
    DEFAULT_FIRST_BUCKET_BYTES,
    BucketPlan,
    ParamInfo,
    plan_buckets,
)
from .stats import BackwardStats, BucketTiming
from .unused_params import (
    marked_twice_error,
    static_count_error,
    static_missing_error,
    unfinished_reduction_error,
    unreached_params,
    unused_parameters_error,
)

__all__ = ["Reducer", "ReducerState", "BackwardStats", "BucketTiming"]

_now = time.perf_counter_ns
class ReducerState(Enum):
    """Where the reducer is in an iteration (each transition is checked)."""

    IDLE = "idle"  # no synced backward expected: hooks only record local use (no_sync)
    PREPARED = "prepared"  # a synced forward ran; its backward will reduce
    BACKWARD = "backward"  # the first gradient arrived; finalize is queued
    FINALIZING = "finalizing"  # the queued finalize is running


_IDLE, _PREPARED, _BACKWARD, _FINALIZING = (
    ReducerState.IDLE,
    ReducerState.PREPARED,
    ReducerState.BACKWARD,
    ReducerState.FINALIZING,
)


class Reducer:
    """Averages the gradients of ``params`` across ``process_group`` during backward.

    ``params`` must be distinct tensors that require grad (DDP dedupes and filters them);
    ``names`` are used in error messages and stats.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        process_group: dist.ProcessGroup,
        *,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
        expect_sparse_gradient: Sequence[bool] | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        if not params:
            raise ValueError("DistributedDataParallel needs at least one parameter that requires grad")
        self._params = list(params)
        self._names = list(names)
        n = len(self._params)
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._pg = process_group
        self._world_size = dist.get_world_size(process_group)
        self._inv = 1.0 / self._world_size
        self._div = self._world_size  # the averaging divisor (see set_divide_factor)
        self._scale = self._world_size != 1
        self._find_unused = find_unused_parameters
        self._as_view = gradient_as_bucket_view
        self._static = static_graph
        self._cap = bucket_cap_bytes
        self._first_cap = first_bucket_bytes
        self._sparse = list(expect_sparse_gradient or [False] * n)
        self._infos = [ParamInfo.of(p, s) for p, s in zip(self._params, self._sparse, strict=True)]
        self._map_device = self._params[0].device
        self._hook: Callable | None = None
        self._hook_state = None

        self._state = _IDLE
        self._used = [0] * n  # see [Note: the used map]
        self._ready = [False] * n
        self._ready_ns = [-1] * n
        self._base_ns = _now()
        self._finalize_start_ns = self._finalize_end_ns = -1
        self._next_bucket = 0
        self._unused_at_start: list[int] = []
        # Static graph: hook counts of the first iteration become the expected counts.
        self._hook_count = [0] * n if static_graph else None
        self._expected: list[int] | None = None
        self._static_global_used: list[int] | None = None
        self._delay_all = False
        # Bucket rebuild: record the ready order of the first synced backward, once.
        self._rebuild_allowed = static_graph or not find_unused_parameters
        self._record_order = False
        self._ready_order: list[int] = []
        self._rebuild_order: list[int] | None = None
        self.buckets_rebuilt = False

        self._buckets: list[Bucket] = []
        self._bucket_of: list[Bucket] = []
        self._view_of: list[torch.Tensor | None] = []
        self._install(plan_buckets(self._infos, self._cap, self._first_cap, self._sparse))

        ref = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(_make_hook(ref, i)) for i, p in enumerate(self._params)]

    # ----------------------------------------------------------------- setup
    def _install(self, plans: Sequence[BucketPlan]) -> None:
        """Allocate buffers for ``plans``; with bucket views, move existing grads into them."""
        n = len(self._params)
        # Drop the old buffers before allocating new ones (a rebuild must not hold both).
        self._buckets, self._bucket_of, self._view_of = [], [], []
        self._plans = tuple(plans)
        self._buckets = [
            Bucket(plan, [self._params[i] for i in plan.param_indices], plan.index == len(plans) - 1)
            for plan in plans
        ]
        self._bucket_of = [None] * n  # type: ignore[list-item]
        self._view_of = [None] * n
        for b in self._buckets:
            b.fuse_scale = (
                self._scale and self._hook is None and not self._as_view and not b.sparse
                and b.plan.numel >= FUSE_MIN_NUMEL * len(b.params)
            )
            for k, i in enumerate(b.plan.param_indices):
                self._bucket_of[i] = b
                if not b.sparse:
                    view = b.views[k]
                    self._view_of[i] = view
                    p = self._params[i]
                    if self._as_view and p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view

    @property
    def plan(self) -> tuple[BucketPlan, ...]:
        """The bucket plan in use (after a rebuild, the ready-order one)."""
        return self._plans

    @property
    def state(self) -> ReducerState:
        return self._state

    def register_comm_hook(self, state, hook: Callable) -> None:
        if self._hook is not None:
            raise RuntimeError("register_comm_hook may only be called once per DDP instance")
        if self._state is not _IDLE:
            raise RuntimeError(f"register_comm_hook called while the reducer is {self._state.value}; call it before forward")
        self._hook, self._hook_state = hook, state
        for b in self._buckets:
            b.fuse_scale = False  # the hook receives the plain sum and divides itself

    def __del__(self) -> None:
        for h in getattr(self, "_handles", ()):
            h.remove()

    # ------------------------------------------------------------- iteration
    def set_divide_factor(self, divisor: int) -> None:
        """Average the next synced backward over ``divisor`` ranks (uneven inputs, join)."""
        if self._state is not _IDLE and self._state is not _PREPARED:
            raise RuntimeError(f"set_divide_factor called while the reducer is {self._state.value}")
        self._div = divisor
        self._inv = 1.0 / divisor

    def prepare_for_forward(self) -> None:
        """Before a synced forward: refuse a half-finished iteration, rebuild buckets once."""
        if self._state is _BACKWARD:
            pending = [self._names[i] for i in range(len(self._params)) if not self._ready[i]]
            self._abort()
            raise unfinished_reduction_error(pending)
        if self._rebuild_order is not None:
            self._rebuild()

    def skip_backward(self) -> None:
        """A forward outside sync (no_sync / no grad): its backward only accumulates."""
        if self._state is _PREPARED:
            self._state = _IDLE

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        """After a synced forward: the next backward reduces. ``outputs`` feed the graph walk."""
        if self._state is not _IDLE and self._state is not _PREPARED:
            raise RuntimeError(f"prepare_for_backward called while the reducer is {self._state.value}")
        n = len(self._params)
        self._ready = [False] * n
        self._ready_ns = [-1] * n
        self._next_bucket = 0
        for b in self._buckets:
            b.pending = len(b.params)
            b.launch_ns = b.finish_cell[0] = -1
        self._record_order = self._rebuild_allowed and not self.buckets_rebuilt
        self._ready_order = []
        self._delay_all = False
        if self._static:
            self._hook_count = [0] * n
            if self._expected is None:
                self._delay_all = True
                self._unused_at_start = []
            else:
                self._unused_at_start = [i for i in range(n) if self._expected[i] == 0]
        elif self._find_unused:
            self._unused_at_start = unreached_params(outputs, self._index_of, len(self._params))
        else:
            self._unused_at_start = []
        self._state = _PREPARED
        self._base_ns = _now()
        if self._find_unused and not self._static and len(self._unused_at_start) == n:
            self._reduce_without_backward()

    def attach_to_outputs(self, outputs: Sequence[torch.Tensor]) -> None:
        """See [Note: finalize on the outer backward]."""
        seen = set()
        for t in outputs:
            fn = t.grad_fn
            if fn is not None and fn not in seen:
                seen.add(fn)
                fn.register_prehook(self._output_prehook)

    def _output_prehook(self, grad_outputs):
        if self._state is _PREPARED:
            self._begin_backward()

    def shadow_backward(self) -> None:
        """A joined rank (uneven inputs): issue one synced backward's collectives with zeros.

        Same buckets in the same order (through the comm hook when there is one), then the
        used map where the active ranks all-reduce it; this rank's ``.grad`` is untouched.
        """
        if self._state is not _IDLE and self._state is not _PREPARED:
            raise RuntimeError(f"a joined rank shadowed a backward while its reducer is {self._state.value}")
        if self._static or any(b.sparse for b in self._buckets):
            raise RuntimeError("join (uneven inputs) is not supported with static_graph or sparse gradients")
        works = []
        for b in self._buckets:
            zeros = torch.zeros_like(b.buffer)
            if self._hook is not None:
                b.grad_bucket.set_buffer(zeros)
                works.append(self._hook(self._hook_state, b.grad_bucket))
            else:
                works.append(dist.all_reduce(zeros, group=self._pg, async_op=True))
        for w in works:
            w.wait()
        if self._find_unused:
            used = torch.zeros(len(self._params), dtype=torch.int32, device=self._map_device)
            dist.all_reduce(used, group=self._pg)
        if self._rebuild_allowed and not self.buckets_rebuilt and self._rebuild_order is None:
            # Active ranks rebuild at their next synced forward; rank 0's order wins, so ours
            # only has to exist (torch pushes the default order likewise).
            self._rebuild_order = list(range(len(self._params)))
        self._state = _IDLE

    def _reduce_without_backward(self) -> None:
        """See [Note: a rank that uses no parameter]."""
        self._state = _BACKWARD
        params = self._params
        for j in self._unused_at_start:
            self._mark_ready(j, params[j])
        self._finalize()

    # ------------------------------------------------------------ hook path
    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``i`` (the hot path: keep it flat)."""
        state = self._state
        if state is not _BACKWARD:
            if state is _PREPARED:
                self._begin_backward()
            else:
                self._used[i] = 1  # no_sync (or a backward outside DDP): remember the use
                return
        counts = self._hook_count
        if counts is not None:
            c = counts[i] = counts[i] + 1
            if self._delay_all:
                if c == 1:
                    self._used[i] = 1
                    self._ready_ns[i] = _now() - self._base_ns
                    self._ready_order.append(i)
                return
            expected = self._expected[i]  # type: ignore[index]
            if c != expected:
                if c < expected:
                    return
                self._fail(static_count_error(self._names[i], c, expected))
        elif self._ready[i]:
            self._fail(marked_twice_error(self._names[i], i in self._unused_at_start))
        self._used[i] = 1
        # Inlined _mark_ready for a used dense parameter: one Python frame per gradient.
        self._ready[i] = True
        self._ready_ns[i] = _now() - self._base_ns
        if self._record_order:
            self._ready_order.append(i)
        b = self._bucket_of[i]
        if not b.sparse:
            view = self._view_of[i]
            g = p.grad
            if g is not view:
                if b.fuse_scale:
                    torch.mul(g, self._inv, out=view)
                else:
                    view.copy_(g)
                if self._as_view:
                    p.grad = view
        b.pending -= 1
        if b.pending == 0 and b.index == self._next_bucket:
            self._launch_ready()

    def _mark_ready(self, i: int, p: torch.Tensor) -> None:
        """Mark a parameter whose hook did not fire (unused here): its current grad or zeros."""
        self._ready[i] = True
        self._ready_ns[i] = _now() - self._base_ns
        if self._record_order:
            self._ready_order.append(i)
        b = self._bucket_of[i]
        if not b.sparse:
            view = self._view_of[i]
            g = p.grad
            if g is None:
                view.zero_()
            elif g is not view:
                if b.fuse_scale:
                    torch.mul(g, self._inv, out=view)
                else:
                    view.copy_(g)
                if self._as_view:
                    p.grad = view
        b.pending -= 1
        if b.pending == 0 and b.index == self._next_bucket:
            self._launch_ready()

    def _begin_backward(self) -> None:
        self._state = _BACKWARD
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        params = self._params
        for j in self._unused_at_start:
            self._mark_ready(j, params[j])

    def _launch_ready(self) -> None:
        buckets = self._buckets
        nb = len(buckets)
        while self._next_bucket < nb and buckets[self._next_bucket].pending == 0:
            b = buckets[self._next_bucket]
            self._next_bucket += 1
            b.launch(self._pg, self._div, self._hook, self._hook_state)

    # -------------------------------------------------------------- finalize
    def _finalize(self) -> None:
        """Runs once at the end of a synced backward (queued by the first hook)."""
        if self._state is not _BACKWARD:
            return  # reset after an error raised inside backward
        self._state = _FINALIZING
        self._finalize_start_ns = _now()
        try:
            self._finalize_inner()
        except BaseException:
            self._abort()
            raise
        self._finalize_end_ns = _now()
        self._used = [0] * len(self._params)
        self._state = _IDLE
        if self._div != self._world_size:
            self.set_divide_factor(self._world_size)  # join sets it per iteration

    def _finalize_inner(self) -> None:
        n = len(self._params)
        params = self._params
        need_used_map = self._find_unused and not self._static
        if self._delay_all:
            # First static-graph iteration: learn hook counts, then reduce everything.
            self._expected = list(self._hook_count)  # type: ignore[arg-type]
            self._ready_order += [i for i in range(n - 1, -1, -1) if self._expected[i] == 0]
            self._delay_all = False
            record, self._record_order = self._record_order, False
            for i in range(n):
                self._mark_ready(i, params[i])
            self._record_order = record
            need_used_map = True
        else:
            missing = [i for i in range(n) if not self._ready[i]]
            if missing and not self._find_unused and not self._static:
                raise unused_parameters_error([self._names[i] for i in missing])
            if missing and self._static:
                raise static_missing_error([self._names[i] for i in missing])
            for i in missing:
                self._mark_ready(i, params[i])
        if self._next_bucket != len(self._buckets):
            raise AssertionError(f"reducer finalized with {len(self._buckets) - self._next_bucket} buckets not launched")
        global_used = self._static_global_used
        if need_used_map:
            used = torch.tensor(self._used, dtype=torch.int32, device=self._map_device)
            dist.all_reduce(used, group=self._pg)
            global_used = used.tolist()
            if self._static:
                self._static_global_used = global_used
        for b in self._buckets:
            b.finish(global_used, self._as_view)
        if self._record_order:
            self._record_order = False
            order = self._ready_order
            if len(order) == n and len(set(order)) == n:
                self._rebuild_order = order

    def _abort(self) -> None:
        """After an error: let launched collectives finish, go back to IDLE."""
        for b in self._buckets:
            b.abandon()
        self._used = [0] * len(self._params)
        self._state = _IDLE
        self.set_divide_factor(self._world_size)

    def _fail(self, error: Exception) -> None:
        self._abort()
        raise error

    # ---------------------------------------------------------------- rebuild
    def _rebuild(self) -> None:
        """Re-plan buckets in rank 0's gradient-ready order (same buckets on every rank)."""
        order = torch.tensor(self._rebuild_order, dtype=torch.long, device=self._map_device)
        dist.broadcast(order, src=dist.get_global_rank(self._pg, 0), group=self._pg)
        self._rebuild_order = None
        self.buckets_rebuilt = True
        self._install(
            plan_buckets(self._infos, self._cap, self._first_cap, self._sparse, order=order.tolist())
        )

    # ------------------------------------------------------------------ stats
    def get_backward_stats(self) -> BackwardStats:
        """Timings of the last synced backward, in ns since ``prepare_for_backward``."""
        base = self._base_ns
        return BackwardStats(
            param_names=tuple(self._names),
            param_ready_ns=tuple(t if t >= 0 else None for t in self._ready_ns),
            buckets=tuple(
                BucketTiming(
                    index=b.index,
                    param_indices=b.plan.param_indices,
                    nbytes=b.plan.nbytes,
                    launch_ns=b.launch_ns - base if b.launch_ns >= 0 else None,
                    finish_ns=b.finish_cell[0] - base if b.finish_cell[0] >= 0 else None,
                )
                for b in self._buckets
            ),
            backward_end_ns=self._finalize_start_ns - base if self._finalize_start_ns >= base else None,
            finalize_end_ns=self._finalize_end_ns - base if self._finalize_end_ns >= base else None,
        )


def _make_hook(ref: weakref.ref, i: int):
    """The per-parameter hook: a weak reference so the reducer can be collected."""

    def hook(param: torch.Tensor) -> None:
        reducer = ref()
        if reducer is not None:
            reducer._on_grad(i, param)

    return hook
