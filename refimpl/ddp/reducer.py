"""The reducer: averages gradients across ranks during backward, bucket by bucket.

``naive.py`` all-reduces every gradient after backward. The reducer computes the same
averages but overlaps communication with backward. One synced iteration, in four steps::

    1. mark ready    a parameter's gradient is accumulated (its hook fires, or finalize finds
                     it unused): copy it into its slot of a flat bucket buffer
    2. bucket full   the bucket's last slot is filled
    3. launch        scale that bucket by 1/W and start its asynchronous all-reduce -- and
                     every full bucket after it (``Bucket.launch``), strictly in bucket
                     order, so all ranks issue the same collectives in the same order
                     whatever order their gradients arrive in
    4. finalize      when backward ends: mark what never got a gradient, then per bucket
                     wait, copy back to ``.grad`` (``Bucket.finish``)

States (``ReducerState``)::

    IDLE --prepare_for_backward()--> PREPARED --first grad hook--> BACKWARD
         <------------------- finalize (queued autograd callback) --------

``prepare_for_backward`` (after a synced forward) resets the per-iteration tables and, with
``find_unused_parameters``, walks the autograd graph from the outputs to learn which
parameters cannot get a gradient: they are marked ready (zeros) as backward begins.

[Note: why finalize raises] PyTorch queues its finalizer only once every bucket is launched,
so a parameter that never gets a gradient is only reported at the *next* forward, after an
optimizer step on unsynchronised gradients (pytorch/pytorch#128949). Queuing at the first
hook lets us raise at the end of the very backward that went wrong.

[Note: finalize on the outer backward] The finalize callback is queued on the graph task
that is running when it is queued. A reentrant backward (``torch.utils.checkpoint`` with
``use_reentrant=True``) runs each checkpointed segment's backward as a graph task of its
own, so a callback queued by the first gradient hook would run when the first *segment*
ends. ``attach_to_outputs`` therefore registers a pre-hook on the forward outputs'
autograd nodes: it runs first, in the outer graph task, and queues finalize there. The
gradient hooks only fall back to queuing it when backward did not start from an output.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from enum import Enum

import torch
import torch.distributed as dist

from .. import _torch_compat as compat
from .buckets import Bucket
from .plan import (
    DEFAULT_BUCKET_CAP_BYTES,
    DEFAULT_FIRST_BUCKET_BYTES,
    BucketPlan,
    ParamInfo,
    plan_buckets,
)
from .static_graph import StaticGraph
from .stats import BackwardStats, BucketTiming, backward_stats
from .unused_params import (
    marked_twice_error,
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
        self._div = self._world_size  # the averaging divisor (see set_divide_factor)
        self._find_unused = find_unused_parameters
        self._as_view = gradient_as_bucket_view
        self._static = StaticGraph(n) if static_graph else None
        self._cap = bucket_cap_bytes
        self._first_cap = first_bucket_bytes
        self._sparse = list(expect_sparse_gradient or [False] * n)
        self._infos = [ParamInfo.of(p, s) for p, s in zip(self._params, self._sparse, strict=True)]
        self._map_device = self._params[0].device
        self._hook: Callable | None = None
        self._hook_state = None

        self._state = _IDLE
        self._used = [0] * n  # see [Note: the used map] in unused_params.py
        self._ready = [False] * n
        self._ready_ns = [-1] * n
        self._base_ns = _now()
        self._finalize_start_ns = self._finalize_end_ns = -1
        self._next_bucket = 0
        self._unused_at_start: list[int] = []
        # Bucket rebuild: record the ready order of the first synced backward, once.
        self._rebuild_allowed = static_graph or not find_unused_parameters
        self._record_order = False
        self._ready_order: list[int] = []
        self._rebuild_order: list[int] | None = None
        self.buckets_rebuilt = False

        self._buckets: list[Bucket] = []
        self._bucket_of: list[Bucket] = []
        self._slot_of: list[int] = []
        self._install(plan_buckets(self._infos, self._cap, self._first_cap, self._sparse))

        # [Note: hooks from several threads] torch runs one autograd thread per device, so a
        # module spread over devices gets its gradient hooks from several threads at once; the
        # ready counts, the next bucket to launch and the state are read and written under this
        # lock (torch's C++ reducer holds its mutex likewise). Collectives launch under it too,
        # which keeps the launch order the same on every rank.
        self._lock = threading.Lock()
        self._on_grad_fn = type(self)._on_grad_static if static_graph else type(self)._on_grad
        ref = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(_make_hook(ref, i)) for i, p in enumerate(self._params)]

    # ----------------------------------------------------------------- setup
    def _install(self, plans: Sequence[BucketPlan]) -> None:
        """Allocate buffers for ``plans``; with bucket views, move existing grads into them."""
        # Drop the old buffers before allocating new ones (a rebuild must not hold both).
        self._buckets, self._bucket_of, self._slot_of = [], [], []
        self._plans = tuple(plans)
        self._buckets = [
            Bucket(plan, [self._params[i] for i in plan.param_indices], plan.index == len(plans) - 1) for plan in plans
        ]
        n = len(self._params)
        self._bucket_of = [None] * n  # type: ignore[list-item]
        self._slot_of = [0] * n
        for b in self._buckets:
            for k, i in enumerate(b.plan.param_indices):
                self._bucket_of[i] = b
                self._slot_of[i] = k
                if self._as_view and not b.sparse and self._params[i].grad is not None:
                    b.copy_in(k, as_view=True)

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

    def __del__(self) -> None:
        for h in getattr(self, "_handles", ()):
            h.remove()

    # ------------------------------------------------------------- iteration
    def set_divide_factor(self, divisor: int) -> None:
        """Average the next synced backward over ``divisor`` ranks (uneven inputs, join)."""
        if self._state is not _IDLE and self._state is not _PREPARED:
            raise RuntimeError(f"set_divide_factor called while the reducer is {self._state.value}")
        self._div = divisor

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
        if self._static is not None:
            self._unused_at_start = self._static.begin()
        elif self._find_unused:
            self._unused_at_start = unreached_params(outputs, self._index_of, n)
        else:
            self._unused_at_start = []
        self._state = _PREPARED
        self._base_ns = _now()
        if self._find_unused and self._static is None and len(self._unused_at_start) == n:
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
        with self._lock:  # [Note: hooks from several threads]
            if self._state is _PREPARED:
                self._begin_backward()

    def _begin_backward(self) -> None:
        self._state = _BACKWARD
        compat.queue_backward_callback(self._finalize)
        for i in self._unused_at_start:
            self._mark_ready(i)

    def _reduce_without_backward(self) -> None:
        """See [Note: a rank that uses no parameter] in unused_params.py."""
        self._state = _BACKWARD
        for i in self._unused_at_start:
            self._mark_ready(i)
        self._finalize()

    # ------------------------------------------------- steps 1-3: during backward
    def grad_ready(self, i: int) -> None:
        """Parameter ``i``'s gradient was accumulated (what its hook calls, from any thread)."""
        with self._lock:  # [Note: hooks from several threads]
            self._on_grad_fn(self, i)

    def _on_grad(self, i: int) -> None:
        """Parameter ``i``'s post-accumulate-grad hook (dynamic graph)."""
        state = self._state
        if state is not _BACKWARD:
            if state is not _PREPARED:
                self._used[i] = 1  # no_sync (or a backward outside DDP): remember the use
                return
            self._begin_backward()
        if self._ready[i]:
            self._fail(marked_twice_error(self._names[i], i in self._unused_at_start))
        self._used[i] = 1
        self._mark_ready(i)

    def _on_grad_static(self, i: int) -> None:
        """The hook with static_graph: ready once the learnt number of gradients arrived."""
        state = self._state
        if state is not _BACKWARD:
            if state is not _PREPARED:
                self._used[i] = 1
                return
            self._begin_backward()
        graph = self._static
        try:
            complete = graph.count(i, self._names[i])  # type: ignore[union-attr]
        except RuntimeError as exc:
            self._fail(exc)
        if not complete:
            return
        self._used[i] = 1
        if graph.learning:  # type: ignore[union-attr]
            # First iteration: note the arrival only; finalize marks everything ready.
            self._ready_ns[i] = _now() - self._base_ns
            self._ready_order.append(i)
            return
        self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        """Step 1: parameter ``i``'s gradient (or zeros) goes into its bucket; step 2: full?"""
        self._ready[i] = True
        self._ready_ns[i] = _now() - self._base_ns
        if self._record_order:
            self._ready_order.append(i)
        b = self._bucket_of[i]
        b.copy_in(self._slot_of[i], self._as_view)
        b.pending -= 1
        if b.pending == 0 and b.index == self._next_bucket:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Step 3: launch every full bucket from the next one on, in bucket order."""
        buckets = self._buckets
        nb = len(buckets)
        scale = None if self._div == 1 else 1.0 / self._div  # see [Note: where 1/W is applied]
        while self._next_bucket < nb and buckets[self._next_bucket].pending == 0:
            b = buckets[self._next_bucket]
            self._next_bucket += 1
            b.launch(self._pg, self._hook, self._hook_state, scale)

    # ----------------------------------------------------- step 4: finalize
    def _finalize(self) -> None:
        """Runs once at the end of a synced backward (queued when backward began)."""
        if self._state is not _BACKWARD:
            return  # reset after an error raised inside backward
        self._state = _FINALIZING
        self._finalize_start_ns = _now()
        try:
            global_used = self._mark_the_rest_ready()
            for b in self._buckets:
                b.finish(global_used, self._as_view)  # wait, copy back
        except BaseException:
            self._abort()
            raise
        if self._record_order:
            self._record_order = False
            order = self._ready_order
            if len(order) == len(self._params) and len(set(order)) == len(order):
                self._rebuild_order = order
        self._finalize_end_ns = _now()
        self._used = [0] * len(self._params)
        self._state = _IDLE
        self._div = self._world_size  # join sets it per iteration

    def _mark_the_rest_ready(self) -> list[int] | None:
        """Mark what got no gradient (or raise); return the all-reduced used map if needed."""
        n = len(self._params)
        graph = self._static
        need_used_map = self._find_unused and graph is None
        if graph is not None and graph.learning:
            self._ready_order += graph.learn()
            record, self._record_order = self._record_order, False
            for i in range(n):
                self._mark_ready(i)
            self._record_order = record
            need_used_map = True
        else:
            missing = [i for i in range(n) if not self._ready[i]]
            if missing and graph is not None:
                raise static_missing_error([self._names[i] for i in missing])
            if missing and not self._find_unused:
                raise unused_parameters_error([self._names[i] for i in missing])
            for i in missing:
                self._mark_ready(i)
        if self._next_bucket != len(self._buckets):
            raise AssertionError(f"reducer finalized with {len(self._buckets) - self._next_bucket} buckets not launched")
        if not need_used_map:
            return graph.global_used if graph is not None else None
        used = torch.tensor(self._used, dtype=torch.int32, device=self._map_device)
        dist.all_reduce(used, group=self._pg)
        global_used = used.tolist()
        if graph is not None:
            graph.global_used = global_used
        return global_used

    def _abort(self) -> None:
        """After an error: let launched collectives finish, go back to IDLE."""
        for b in self._buckets:
            b.abandon()
        self._used = [0] * len(self._params)
        self._state = _IDLE
        self._div = self._world_size

    def _fail(self, error: Exception) -> None:
        self._abort()
        raise error

    # ------------------------------------------------------ join, rebuild, stats
    def shadow_backward(self) -> None:
        """A joined rank (uneven inputs): issue one synced backward's collectives with zeros.

        Same buckets in the same order (through the comm hook when there is one), then the
        used map where the active ranks all-reduce it; this rank's ``.grad`` is untouched.
        """
        if self._state is not _IDLE and self._state is not _PREPARED:
            raise RuntimeError(f"a joined rank shadowed a backward while its reducer is {self._state.value}")
        if self._static is not None or any(b.sparse for b in self._buckets):
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

    def _rebuild(self) -> None:
        """Re-plan buckets in rank 0's gradient-ready order (same buckets on every rank)."""
        order = torch.tensor(self._rebuild_order, dtype=torch.long, device=self._map_device)
        dist.broadcast(order, src=dist.get_global_rank(self._pg, 0), group=self._pg)
        self._rebuild_order = None
        self.buckets_rebuilt = True
        self._install(plan_buckets(self._infos, self._cap, self._first_cap, self._sparse, order=order.tolist()))

    def get_backward_stats(self) -> BackwardStats:
        """Timings of the last synced backward, in ns since ``prepare_for_backward``."""
        return backward_stats(
            self._names, self._ready_ns, self._buckets, self._base_ns, self._finalize_start_ns, self._finalize_end_ns
        )


def _make_hook(ref: weakref.ref, i: int):
    """Parameter ``i``'s hook: a weak reference so the reducer can be collected."""

    def hook(param: torch.Tensor) -> None:
        reducer = ref()
        if reducer is not None:
            reducer.grad_ready(i)

    return hook
