"""Interaction bugs in reduce-scatter bucketers (issue 38), written from the contract alone.

The bucketer counterpart of `interactions_ddp.py` and `interactions_sharded.py`: each mutant is
the independent zoo's contract bucketer (`conformance.mutants.independent.bucketer.Bucketer`),
correct everywhere except where two things meet — bucketing disabled and a keyword call, a cap
in the negative regime, bf16 on the path that reduces at once, a keyword call whose inputs the
caller reuses. Written from `docs/contracts/bucketer.md` (B2, B4, B6, B8, B12) and FairScale's
`Usage::` docstring, without reading the scenario catalogue.

`mutation_fired` counts only where the bug changed what the correct bucketer would have done.
Run::

    gradparity zoo --area bucketer --set interactions --profile standard
"""

from __future__ import annotations

import torch

from conformance.mutants.independent.bucketer import Bucketer
from conformance.mutants.independent.bucketer import Correct as _IndependentCorrect
from conformance.mutants.registry import Registry

MUTANTS = Registry("ix-bucketer")
_MiB = 1024 * 1024


class Correct(_IndependentCorrect):
    name = "ix-bucketer-correct"


def mutant(name: str, clause: str, pair: str, bug: str):
    """Register a Bucketer subclass as mutant `name`, wrapped in an adapter class; `pair` names
    the two things that meet."""
    def adapter(bucketer_cls):
        return type(f"{bucketer_cls.__name__}Adapter", (Correct,), {"bucketer_class": bucketer_cls})
    return MUTANTS.interaction(name, clause, pair, bug, adapter=adapter)


@mutant("disabled-keyword-callback-lost", "B8", "cap <= 0 x a keyword call",
        "the bucketing-disabled fast path reads callback_fn positionally, so "
        "callback_fn= given by keyword is never called")
class DisabledKeywordCallbackLost(Bucketer):
    @torch.no_grad()
    def reduce_scatter_async(self, *args, **kwargs):
        if self.bucket_cap_mb > 0:
            return super().reduce_scatter_async(*args, **kwargs)
        input_list = args[0] if args else kwargs["input_list"]
        group = args[1] if len(args) > 1 else kwargs["group"]
        callback_fn = args[2] if len(args) > 2 else None  # the bug: callback_fn= by keyword dropped
        self._fired(kwargs.get("callback_fn") is not None)
        return super().reduce_scatter_async(input_list, group, callback_fn)


@mutant("negative-cap-buckets", "B4", "a negative cap x an input that fits |cap|",
        "the shard size is computed from |cap| (only 0 disables bucketing), "
        "so inputs are queued where every input must be reduced before its call returns")
class NegativeCapBuckets(Bucketer):
    def shard_size(self, dtype: torch.dtype, group_size: int) -> int:
        if self.bucket_cap_mb == 0:
            return 0
        return int(abs(self.bucket_cap_mb) * _MiB // dtype.itemsize // group_size)

    def immediate(self, numel: int, shard: int) -> bool:
        self._fired(self.bucket_cap_mb < 0 and numel <= shard)
        return numel > shard


@mutant("bf16-immediate-upcasts", "B12", "bf16 x the path that reduces at once",
        "an input larger than a shard, or any with bucketing disabled, is summed in fp32 for backends without bf16 and handed back as fp32 (the bucketed path keeps bf16)")
class Bf16ImmediateUpcasts(Bucketer):
    @torch.no_grad()
    def reduce_scatter_async(self, input_list, group, callback_fn=None):
        inputs = list(input_list)
        first = inputs[0]
        numel = first.numel()
        if (first.dtype == torch.bfloat16 and numel
                and self.immediate(numel, self.shard_size(first.dtype, group.size()))):
            out = self.reduce(torch.cat([t.reshape(-1).float() for t in inputs]), numel, group)
            self._fired()
            if callback_fn is not None:
                callback_fn(out.view(first.shape))  # the bug: never cast back to bf16
            return
        return super().reduce_scatter_async(inputs, group, callback_fn)


@mutant("keyword-queues-caller-tensors", "B6", "a keyword call x inputs reused after it returns",
        "keyword calls queue the caller's tensors and stage them "
        "at flush (positional calls copy at once), so overwriting the inputs changes the result")
class KeywordQueuesCallerTensors(Bucketer):
    _keyword = False

    @torch.no_grad()
    def reduce_scatter_async(self, *args, **kwargs):
        self._keyword = not args
        try:
            return super().reduce_scatter_async(*args, **kwargs)
        finally:
            self._keyword = False

    def add(self, bucket, inputs, callback_fn) -> None:
        if not self._keyword:
            return super().add(bucket, inputs, callback_fn)
        if bucket.data is None:
            bucket.data = self.allocate(bucket)
        numel = inputs[0].numel()
        # the bug: the caller's tensors, staged later (a clone kept only to count where it mattered)
        bucket.__dict__.setdefault("lazy", []).append((bucket.offset, inputs, [t.clone() for t in inputs]))
        bucket.queue.append((callback_fn, bucket.offset, numel, inputs[0].shape))
        bucket.offset += numel

    def flush_bucket(self, bucket, making_room: bool = False) -> None:
        for offset, inputs, seen in bucket.__dict__.pop("lazy", []):
            self._fired(any(not torch.equal(a, b) for a, b in zip(inputs, seen, strict=True)))
            for row, chunk in zip(bucket.data, inputs, strict=True):
                row[offset:offset + chunk.numel()].copy_(chunk.reshape(-1))
        super().flush_bucket(bucket, making_room)


def correct() -> Correct:
    return Correct()


globals().update(MUTANTS.factories())
