"""The mutants: `BucketedDDP` with exactly one bug each.

Every mutant overrides one or two small methods of `base.BucketedDDP` and calls
`self._fired()` where its bug *changes* what the correct code would have done (a division
that mattered, a bucket that existed and was skipped, a cast that rounded a value, ...).
`bug` is the one-line description the zoo prints. `may_abort = True` marks a mutant whose
failure mode is a hang or a crash (no rank record comes back, so no fired count either).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor, nn

from conformance.mutants.base import Bucket, BucketedDDP, CopyBack


class NoDivide(BucketedDDP):
    bug = "sums gradients across ranks without dividing by the world size"

    def _scale(self, flat: Tensor) -> None:
        if self.world_size > 1 and bool(flat.any()):
            self._fired()


def _differs_from(reference: Tensor, group, *, src: int | None = None) -> bool:
    """Whether what the correct collective gives (on a copy) differs from `reference`.

    Used only to decide whether a skipped collective *mattered*; every rank calls it in the
    same order, so it never mismatches the real collectives.
    """
    copy = reference.detach().clone()
    if src is None:
        dist.all_reduce(copy, group=group)
    else:
        dist.broadcast(copy, group=group, group_src=src)
    return not torch.equal(copy, reference)


class LastBucketNeverReduced(BucketedDDP):
    bug = "the last bucket is divided but never all-reduced (each rank keeps its own share)"

    def _communicate(self, b: Bucket):
        if b.index == len(self.buckets) - 1:
            if self.world_size > 1 and _differs_from(b.flat, self.group):
                self._fired()  # the reduced sum is not what this rank kept
            return None
        return super()._communicate(b)


class NoInitBroadcast(BucketedDDP):
    bug = "no construction-time broadcast: ranks start from their own parameters and buffers"

    def _sync_module_states(self) -> None:
        state = list(self.module.parameters()) + self._buffers_by_name()
        if self.world_size > 1 and sum(_differs_from(t, self.group, src=0) for t in state):
            self._fired()  # some tensor differed from rank 0's


class SkipUnused(BucketedDDP):
    bug = "find_unused_parameters: unused parameters are never marked ready, their bucket waits forever (hang)"
    may_abort = True

    def _mark_unused(self, params: list[nn.Parameter]) -> None:
        if params:
            self._fired(len(params))

    def _on_stuck(self, stuck: list[Bucket]) -> None:
        while any(b.pending for b in stuck):  # a reducer that trusts its counters waits
            time.sleep(0.05)


class NoSyncDropsAccumulated(BucketedDDP):
    bug = "no_sync: the synced backward drops the micro-batches accumulated under no_sync()"

    def _prepare_for_backward(self, out) -> None:
        for p in self._params:
            if p.grad is not None:
                self._fired()
                p.grad = None
        super()._prepare_for_backward(out)


class SwappedBuckets(BucketedDDP):
    bug = "odd ranks launch two same-size buckets in swapped order (rank-dependent collective order)"

    def _launch_order(self) -> list[int]:
        order = super()._launch_order()
        if self.rank % 2 == 1:
            by_size: dict[tuple, list[int]] = {}
            for b in self.buckets:
                by_size.setdefault((b.numel, b.dtype), []).append(b.index)
            pair = next((v[:2] for v in by_size.values() if len(v) >= 2), None)
            if pair:
                i, j = order.index(pair[0]), order.index(pair[1])
                order[i], order[j] = order[j], order[i]
                self._fired()
        return order


class Fp16Communication(BucketedDDP):
    bug = "gradients are silently cast to fp16 for the all-reduce"

    def _communicate(self, b: Bucket):
        half = b.flat.to(torch.float16)
        if not torch.equal(half.to(b.dtype), b.flat):
            self._fired()  # the cast rounded (or overflowed) at least one value
        return CopyBack(dist.all_reduce(half, group=self.group, async_op=True), half, b.flat)


class NoBufferBroadcast(BucketedDDP):
    bug = "buffers are never broadcast from rank 0 before forward"

    def _broadcast_buffers(self) -> None:
        buffers = self._buffers_by_name()
        if self.world_size > 1 and sum(_differs_from(b, self.group, src=0) for b in buffers):
            self._fired()  # some buffer differed from rank 0's


class TiedFirstUse(BucketedDDP):
    bug = "a weight used twice is reduced at its first use's hook: the other use's gradient is missed"

    def _prepare_for_backward(self, out) -> None:
        super()._prepare_for_backward(out)
        self._early: set[int] = set()
        graph = self._graph_uses(out)
        for p in self._dense:
            uses = [(node, i) for node, i in graph.get(id(p), []) if node is not None]
            if len(uses) > 1:
                for node, i in uses:
                    node.register_hook(self._use_hook(p, i))

    def _use_hook(self, p: nn.Parameter, i: int):
        def hook(grad_inputs, grad_outputs):
            if id(p) in self._early or not self._require_sync:
                return
            self._early.add(id(p))
            self._fired()
            self._queue_finalize()
            partial = grad_inputs[i].detach()
            self._mark_ready(p, partial if p.grad is None else p.grad + partial)
        return hook

    def _grad_ready_hook(self, p: nn.Parameter) -> None:
        if id(p) not in getattr(self, "_early", ()):
            super()._grad_ready_hook(p)


class SparseNotReduced(BucketedDDP):
    bug = "sparse gradients are left local (never all-gathered)"

    def _reduce_sparse(self, p: nn.Parameter) -> None:
        if self.world_size > 1 and p.grad is not None:
            self._fired()


class BatchWeighted(BucketedDDP):
    bug = "averages weighted by local batch size / global batch size instead of 1 / world size"

    def _scale(self, flat: Tensor) -> None:
        total = torch.tensor([float(self._local_batch)])
        dist.all_reduce(total, group=self.group)
        if self._local_batch * self.world_size != int(total):
            self._fired()
        flat.mul_(self._local_batch / float(total))


class StaleGradient(BucketedDDP):
    bug = "reduces the previous synced step's local gradient instead of this one's"

    def _local_grad(self, p: nn.Parameter, grad: Tensor | None) -> Tensor | None:
        previous = getattr(self, "_previous", {})
        self._previous = previous
        current = None if grad is None else grad.detach().clone()
        old, previous[id(p)] = previous.get(id(p), current), current
        if old is not None and (current is None or not torch.equal(old, current)):
            self._fired()
        return old
