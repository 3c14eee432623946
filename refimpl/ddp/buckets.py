"""One bucket at run time: its flat buffer, its collective in flight, and the write-back.

The plan (``refimpl.ddp.plan.BucketPlan``) says which parameters share the buffer; this
module owns what happens to the buffer in an iteration. The reducer decides *when* a bucket
is launched (in bucket order, once all its gradients are in) and finished (at the end of
backward); a bucket knows *how*: all-reduce, a comm hook, or the sparse all-gather.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .comm_hooks import GradBucket
from .plan import BucketPlan
from .sparse import SparseAllGatherReduction

__all__ = ["FUSE_MIN_NUMEL", "Bucket"]

_now = time.perf_counter_ns

# Mean elements per gradient above which 1/W is fused into the copy (see [Note: where 1/W
# is applied]); below it the per-call overhead of ``torch.mul(out=)`` dominates.
FUSE_MIN_NUMEL = 16384


class Bucket:
    """Runtime state of one planned bucket (the plan itself is immutable)."""

    __slots__ = (
        "plan", "index", "sparse", "buffer", "views", "params", "pending",
        "work", "future", "sparse_reduction", "launch_ns", "grad_bucket",
        "on_done", "fuse_scale", "finish_cell",
    )  # fmt: skip

    def __init__(self, plan: BucketPlan, params: list[torch.Tensor], is_last: bool):
        self.plan = plan
        self.index = plan.index
        self.sparse = plan.sparse
        self.params = params
        self.pending = len(params)
        self.work = self.future = self.sparse_reduction = None
        self.launch_ns = -1
        # [Note: where 1/W is applied] Large gradients are scaled while being copied in
        # (``torch.mul(out=)``: one pass over memory); for small ones that call costs more
        # than the data, so they are copied and the whole buffer is scaled once at launch.
        self.fuse_scale = False
        if plan.sparse:
            self.buffer = None
            self.views = []
        else:
            self.buffer = torch.zeros(plan.numel, dtype=plan.dtype, device=plan.device)
            self.views = [
                self.buffer.narrow(0, off, length).view(shape)
                for off, length, shape in zip(plan.offsets, plan.lengths, plan.shapes, strict=True)
            ]
        self.grad_bucket = GradBucket(
            plan.index, self.buffer, params, self.views, is_last
        )

        # The done-callback writes into a one-slot list, not into the bucket: a closure over
        # the bucket would form a reference cycle and keep old buffers alive after a rebuild.
        finish = self.finish_cell = [-1]

        def on_done(_fut):
            finish[0] = _now()

        self.on_done = on_done

    def launch(self, group, world_size: int, hook, hook_state) -> None:
        """Issue this bucket's collective (all ranks call this in bucket order).

        ``world_size`` is the averaging divisor: the group size, or the number of active
        ranks under join with ``divide_by_initial_world_size=False``.
        """
        b = self
        b.launch_ns = _now()
        if b.sparse:
            p = b.params[0]
            b.sparse_reduction = SparseAllGatherReduction(p.grad, p, group, world_size)
            return
        if hook is not None:
            b.grad_bucket.set_buffer(b.buffer)
            fut = hook(hook_state, b.grad_bucket)
            if not (hasattr(fut, "wait") and hasattr(fut, "add_done_callback")):
                raise TypeError(f"comm hook must return a torch.futures.Future, got {type(fut).__name__}")
            b.future = fut
        else:
            if world_size != 1 and not b.fuse_scale:
                # Average by pre-scaling (as torch does): x/W summed over W ranks.
                b.buffer.mul_(1.0 / world_size)
            b.work = dist.all_reduce(b.buffer, group=group, async_op=True)
            fut = b.work.get_future()
        fut.add_done_callback(b.on_done)

    def finish(self, global_used: list[int] | None, as_view: bool) -> None:
        """Wait for the collective and write the averages to ``.grad``."""
        b = self
        indices = b.plan.param_indices
        if b.sparse:
            result = b.sparse_reduction.result()  # type: ignore[union-attr]
            b.sparse_reduction = None
            b.finish_cell[0] = _now()
            if global_used is None or global_used[indices[0]]:
                b.params[0].grad = result
            return
        if b.work is not None:
            b.work.wait()
            b.work = None
        else:
            result = b.future.wait()  # type: ignore[union-attr]
            b.future = None
            if result is not b.buffer:
                b.buffer.copy_(result.view(-1))
        params, views = b.params, b.views
        if global_used is None and not as_view:
            torch._foreach_copy_([p.grad for p in params], views)
            return
        for k, p in enumerate(params):
            if global_used is not None and not global_used[indices[k]]:
                continue  # no rank used it: leave .grad as it was (None stays None)
            g = p.grad
            if as_view:
                if g is not views[k]:
                    p.grad = views[k]
            elif g is None:
                p.grad = torch.empty_like(p).copy_(views[k])
            else:
                g.copy_(views[k])

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
