"""Known-bad DDPs for the training-loop scenarios (conformance/catalogue/training_loop.py).

Each breaks `BucketedDDP` in one way that only shows when the loop around the engine varies:
how gradients are cleared, how long the run is, whether ranks arrive in lockstep.
"""

from __future__ import annotations

from torch import Tensor

from conformance.mutants.base import BucketedDDP


class CapturedGradTensors(BucketedDDP):
    bug = "writes the averages into the gradient tensors it saw first: after zero_grad(set_to_none=True) they are not p.grad"

    def _finalize(self) -> None:
        captured = getattr(self, "_captured", None)
        if captured is None:
            captured = self._captured = {}
        originals = {}
        for p in self._dense:
            if p.grad is None:
                continue
            first = captured.setdefault(id(p), p.grad)
            if first is not p.grad:
                self._fired()  # the user replaced the tensor (set_to_none): we write into the old one
                originals[id(p)] = p.grad
                p.grad = first
        super()._finalize()
        for p in self._dense:  # hand the user back their (never reduced) tensor
            if id(p) in originals:
                p.grad = originals[id(p)]


class ZeroGradKeepsGradients(BucketedDDP):
    bug = "its own zero_grad() clears only its buckets, not the parameters' .grad"

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.buckets:
            if b.flat is not None:
                b.flat.zero_()
        if any(p.grad is not None and bool(p.grad.ne(0).any()) for p in self._params):
            self._fired()  # the next backward accumulates onto these


class SumAfterWarmup(BucketedDDP):
    bug = "after 8 synced steps (a stateful comm hook's warm-up) it sums gradients instead of averaging them"

    warmup = 8

    def _scale(self, flat: Tensor) -> None:
        if self._stats["synced_backwards"] < self.warmup:
            return super()._scale(flat)
        if self.world_size > 1 and bool(flat.ne(0).any()):
            self._fired()


class ReadsBeforeWait(BucketedDDP):
    bug = "copies a bucket back into .grad without waiting for its all-reduce (right only in lockstep)"

    def _finalize(self) -> None:
        launched = [self.buckets[i] for i in self._order[:self._next]]
        early = {}
        for b in launched:
            if b.work is not None and not b.work.is_completed():
                self._fired()
            early[b.index] = b.flat.clone()  # what the grads get: the bucket as it is now
        works = [b.work for b in launched]
        for b in launched:
            b.work = None
        super()._finalize()
        for w in works:  # keep the process group consistent for the next collective
            if w is not None:
                w.wait()
        for b in launched:
            for i, p in enumerate(b.params):
                if p.grad is not None and not p.grad.is_sparse:
                    p.grad.copy_(early[b.index][b.offsets[i]:b.offsets[i] + p.numel()].view_as(p))



