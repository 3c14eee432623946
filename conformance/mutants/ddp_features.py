"""Mutants for the production-training families (conformance/catalogue/ddp_features.py).

Each breaks one thing real training relies on around DDP, and calls `self._fired()` only
where its bug changed what the correct base would have done.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from conformance.mutants.base import Bucket, BucketedDDP, CopyBack


class JoinedRankReplaysGradient(BucketedDDP):
    bug = "join: a rank out of data all-reduces its last local gradient instead of zeros"

    def _mark_ready(self, p: nn.Parameter, grad: Tensor | None) -> None:
        super()._mark_ready(p, grad)
        b, _ = self._where[id(p)]
        if b.pending == 0:  # keep what this rank contributed (before the all-reduce)
            self._last = getattr(self, "_last", {})
            self._last[b.index] = b.flat.detach().clone()

    def _shadow_bucket(self, b: Bucket) -> Tensor:
        last = getattr(self, "_last", {}).get(b.index)
        if last is None:
            return super()._shadow_bucket(b)
        if bool(last.any()):
            self._fired()
        return last


class NonFiniteZeroed(BucketedDDP):
    bug = "non-finite local gradients are zeroed before the all-reduce: GradScaler never sees the overflow"

    def _local_grad(self, p: nn.Parameter, grad: Tensor | None) -> Tensor | None:
        if grad is not None and not bool(torch.isfinite(grad).all()):
            self._fired()
            return torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)
        return grad


class FinalizeOnFirstHook(BucketedDDP):
    bug = "finalize is queued by the first gradient hook: under reentrant checkpointing it runs after one segment"

    def _outputs_backward_started(self) -> None:
        pass  # only the gradient hooks queue finalize

    def _finalize(self) -> None:
        if self._next < len(self._order):
            self._fired()  # buckets still waiting: a reentrant segment's backward ended, not backward
        super()._finalize()


class ZeroFillsUnused(BucketedDDP):
    bug = "a parameter no rank used (e.g. frozen for a while) gets a zero gradient instead of keeping None"

    def _finalize(self) -> None:
        unused = [p for p in self._params
                  if self._globally_used is not None and not self._globally_used[id(p)] and p.grad is None]
        super()._finalize()
        for p in unused:
            p.grad = torch.zeros_like(p)
            self._fired()


class StateDictWithoutPrefix(BucketedDDP):
    bug = "state_dict() drops torch DDP's 'module.' prefix: torch DDP checkpoints do not load"

    def state_dict(self, *args, **kwargs):
        self._fired()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


class _SumInOrder:
    """An all-gather whose wait() sums the ranks' shares in a given order into the bucket."""

    def __init__(self, work, parts: list[Tensor], order: list[int], out: Tensor):
        self.work, self.parts, self.order, self.out = work, parts, order, out

    def wait(self):
        self.work.wait()
        total = self.parts[self.order[0]].clone()
        for r in self.order[1:]:
            total += self.parts[r]
        self.out.copy_(total)


class NondeterministicSum(BucketedDDP):
    bug = "claims determinism, but sums the ranks' shares in an order that changes from run to run"

    gradparity_deterministic = True
    _constructed = 0  # per process: every rank builds the same number of instances

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        NondeterministicSum._constructed += 1
        k = NondeterministicSum._constructed % max(1, self.world_size)
        self._sum_order = list(range(k, self.world_size)) + list(range(k))  # a rotation, new each run

    def _communicate(self, b: Bucket):
        import torch.distributed as dist

        parts = [torch.empty_like(b.flat) for _ in range(self.world_size)]
        if self.world_size > 2 and self._sum_order[0] != 0:
            self._fired()  # fp32 sums of 3+ terms depend on their order
        return _SumInOrder(dist.all_gather(parts, b.flat, group=self.group, async_op=True), parts, self._sum_order, b.flat)


class ArrivalOrderBuckets(BucketedDDP):
    bug = ("takes a bucket as full once a gradient of a later bucket arrives (eager backward's order): under "
           "torch.compile gradients arrive in another order and buckets are reduced before they are full")

    def _mark_ready(self, p: nn.Parameter, grad: Tensor | None) -> None:
        b, _ = self._where[id(p)]
        position = self._order.index(b.index)
        if position < self._next:  # its bucket was launched already: the gradient comes too late
            self._ready.add(id(p))
            return
        for j in self._order[self._next:position]:  # every bucket planned earlier counts as complete
            if self.buckets[j].pending:
                self._fired()  # launched without the gradients it still waits for
                self.buckets[j].pending = 0
        self._launch_ready()
        super()._mark_ready(p, grad)


def _restore_buckets(ref):
    """A global optimizer step pre-hook: copy the mutant's reduced buckets back into .grad."""

    def hook(optimizer, args, kwargs):
        ddp = ref()
        if ddp is None or not ddp.buckets or ddp.buckets[0].flat is None:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                where = ddp._where.get(id(p))
                if where is None or where[0].params[where[1]] is not p or p.grad is None or p.grad.is_sparse:
                    continue  # not this wrapper's parameter (the pool runs other cases in this process)
                reduced = where[0].slot(where[1]).view_as(p)
                if not torch.equal(p.grad, reduced):
                    ddp._fired()  # the user changed .grad after backward (clipping, unscaling): undone here
                p.grad.copy_(reduced)

    return hook


class StepReadsBuckets(BucketedDDP):
    bug = ("the optimizer steps on the engine's reduced buckets, not on .grad: edits between backward and step "
           "(clip_grad_norm_, GradScaler.unscale_) are lost")

    def __init__(self, *args, **kwargs):
        import weakref

        from torch.optim.optimizer import register_optimizer_step_pre_hook

        super().__init__(*args, **kwargs)
        handle = register_optimizer_step_pre_hook(_restore_buckets(weakref.ref(self)))
        weakref.finalize(self, handle.remove)


class _ResultDropped:
    """Waits for a low-precision all-reduce and drops its result (the bucket keeps this rank's share)."""

    def __init__(self, copy_back: CopyBack, ddp: BucketedDDP):
        self.inner, self.ddp = copy_back, ddp

    def wait(self):
        self.inner.work.wait()
        if not torch.equal(self.inner.src.to(self.inner.dst.dtype), self.inner.dst):
            self.ddp._fired()  # the reduced values differ from what this rank keeps


class ReducedNotCopiedBack(BucketedDDP):
    bug = ("mixed_precision: the reduce_dtype all-reduce's result is never copied back into the full-precision "
           "bucket (each rank keeps its own share)")

    def _communicate(self, b: Bucket):
        work = super()._communicate(b)
        return _ResultDropped(work, self) if isinstance(work, CopyBack) else work
