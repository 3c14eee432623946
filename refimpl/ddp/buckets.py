"""One bucket at run time: its flat buffer, its collective in flight, and the write-back.

The plan (``refimpl.ddp.plan.BucketPlan``) says which parameters share the buffer; this
module owns what happens to the buffer in an iteration. The reducer decides *when* (a
gradient is copied in when it is ready, the bucket is launched in bucket order once all its
gradients are in, and finished at the end of backward); a bucket knows *how*:

* ``copy_in``  — put one gradient into its slot (zeros for a parameter without one);
* ``launch``   — scale the bucket by 1/W and start its asynchronous sum: all-reduce, a comm
  hook, or the sparse all-gather;
* ``finish``   — wait for it and copy the result back to ``.grad``.

[Note: where 1/W is applied] ``launch`` is the only place refimpl's DDP divides by the
number of ranks, and it divides *before* the sum, as torch's reducer does: the whole buffer
is scaled once in place (with ``gradient_as_bucket_view`` the gradients *are* the buffer),
a sparse gradient's values before they are gathered. Scaling after the sum would agree
bitwise for a power-of-two W except where the sum itself overflows: W float16 gradients of
~40000 each sum to inf, while their averages are finite (a checkpointed fp16 run found it).
A comm hook returns the average itself (torch's hook contract), so it gets the unscaled
buffer and its result is copied back as it is.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import _torch_compat as compat
from .comm_hooks import GradBucket
from .plan import BucketPlan
from .sparse import SparseAllGatherReduction

__all__ = ["Bucket"]

_now = time.perf_counter_ns

class Bucket:
    """Runtime state of one planned bucket (the plan itself is immutable)."""

    __slots__ = (
        "plan", "index", "sparse", "buffer", "views", "params", "pending",
        "work", "future", "sparse_reduction", "launch_ns", "grad_bucket",
        "on_done", "finish_cell",
    )  # fmt: skip

    def __init__(self, plan: BucketPlan, params: list[torch.Tensor], is_last: bool):
        self.plan = plan
        self.index = plan.index
        self.sparse = plan.sparse
        self.params = params
        self.pending = len(params)
        self.work = self.future = self.sparse_reduction = None
        self.launch_ns = -1
        if plan.sparse:
            self.buffer = None
            self.views = []
        else:
            self.buffer = torch.zeros(plan.numel, dtype=plan.dtype, device=plan.device)
            self.views = [
                self.buffer.narrow(0, off, length).view(shape)
                for off, length, shape in zip(plan.offsets, plan.lengths, plan.shapes, strict=True)
            ]
        self.grad_bucket = GradBucket(plan.index, self.buffer, params, self.views, is_last)

        # The done-callback writes into a one-slot list, not into the bucket: a closure over
        # the bucket would form a reference cycle and keep old buffers alive after a rebuild.
        finish = self.finish_cell = [-1]

        def on_done(_fut):
            finish[0] = _now()

        self.on_done = on_done

    def copy_in(self, k: int, as_view: bool) -> None:
        """Put gradient ``k``'s current value into its slot (zeros when it has none)."""
        if self.sparse:
            return  # sparse gradients are gathered at launch, not copied
        view = self.views[k]
        p = self.params[k]
        g = p.grad
        if g is None:
            view.zero_()
        elif g is not view:
            view.copy_(g)
            if as_view:
                p.grad = view

    def launch(self, group, hook, hook_state, scale: float | None = None) -> None:
        """Scale by ``scale`` (1/W; None: the divisor is 1) and start this bucket's sum over
        ranks (all ranks call this in bucket order); see [Note: where 1/W is applied]."""
        self.launch_ns = _now()
        if self.sparse:
            p = self.params[0]
            grad = p.grad  # None on a rank that did not use it: it still takes part
            if grad is not None and scale is not None:
                grad = grad.mul(scale)  # each share, before coalescing, as torch does
            self.sparse_reduction = SparseAllGatherReduction(grad, p, group)
            return
        if hook is not None:
            self.grad_bucket.set_buffer(self.buffer)
            fut = hook(hook_state, self.grad_bucket)
            if not (hasattr(fut, "wait") and hasattr(fut, "add_done_callback")):
                raise TypeError(f"comm hook must return a torch.futures.Future, got {type(fut).__name__}")
            self.future = fut
        else:
            if scale is not None:
                self.buffer.mul_(scale)
            self.work = dist.all_reduce(self.buffer, group=group, async_op=True)
            fut = self.work.get_future()
        fut.add_done_callback(self.on_done)

    def finish(self, global_used: list[int] | None, as_view: bool) -> None:
        """Wait for the (already averaged) sum and copy it back to ``.grad``.

        ``global_used`` (with unused-parameter detection): a parameter no rank used keeps its
        ``.grad`` as it was.
        """
        indices = self.plan.param_indices
        if self.sparse:
            summed = self.sparse_reduction.result()  # type: ignore[union-attr]
            self.sparse_reduction = None
            self.finish_cell[0] = _now()
            if global_used is None or global_used[indices[0]]:
                self.params[0].grad = summed
            return
        # 1. wait
        if self.work is not None:
            self.work.wait()
            self.work = None
        else:
            result = self.future.wait()  # type: ignore[union-attr]
            self.future = None
            if result is not self.buffer:
                self.buffer.copy_(result.view(-1))
        # 2. copy back
        params, views = self.params, self.views
        if global_used is None and not as_view:
            compat.foreach_copy_([p.grad for p in params], views)
            return
        for k, p in enumerate(params):
            if global_used is not None and not global_used[indices[k]]:
                continue  # no rank used it: leave .grad as it was (None stays None)
            g, view = p.grad, views[k]
            if as_view:
                if g is not view:
                    p.grad = view
            elif g is None:
                p.grad = torch.empty_like(p).copy_(view)
            else:
                g.copy_(view)

    def abandon(self) -> None:
        """After an error: let a launched collective finish, then forget it."""
        try:
            if self.work is not None:
                self.work.wait()
            elif self.future is not None:
                self.future.wait()
        except Exception:  # noqa: BLE001 - the caller's error is the one to report
            pass
        self.work = self.future = self.sparse_reduction = None
