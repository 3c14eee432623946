"""Independent known-bad reduce-scatter bucketers (issue 30), from `docs/contracts/bucketer.md`.

`Correct` is a small bucketer written to the contract (one `(W, shard)` staging buffer per
(dtype, device, group), FIFO callbacks, immediate oversized inputs, a loud `teardown()` of a
bucket still holding inputs); each mutant changes one method the way a person writing it
could. Adapters follow `conformance.adapters.bucketer` (`make(bucket_cap_mb)`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from conformance.mutants.firing import Fires
from conformance.mutants.registry import Registry
from conformance.spec import Capability

MUTANTS = Registry("indep-bucketer")
_MiB = 1024 * 1024
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Bucket:
    def __init__(self, dtype, device, group, shard: int):
        self.dtype, self.device, self.group, self.shard = dtype, device, group, shard
        self.data: torch.Tensor | None = None
        self.offset = 0
        self.queue: list[tuple] = []  # (callback, start, numel, shape)

    @property
    def free(self) -> int:
        return self.shard - self.offset


class Bucketer(Fires):
    """The contract's bucketer; methods are the seams the mutants override."""

    def __init__(self, bucket_cap_mb: float = 25):
        self.bucket_cap_mb = bucket_cap_mb
        self.buckets: dict[tuple, _Bucket] = {}
        self.mutation_fired = 0  # how often the bug changed what the correct code would have done

    def shard_size(self, dtype: torch.dtype, group_size: int) -> int:
        if self.bucket_cap_mb <= 0:
            return 0
        return int(self.bucket_cap_mb * _MiB // dtype.itemsize // group_size)

    def immediate(self, numel: int, shard: int) -> bool:
        return numel > shard

    @torch.no_grad()
    def reduce_scatter_async(self, input_list, group, callback_fn=None):
        inputs = list(input_list)
        first = inputs[0]
        numel = first.numel()
        if numel == 0:
            if callback_fn is not None:
                callback_fn(first.new_empty(first.shape))
            return
        if self.immediate(numel, self.shard_size(first.dtype, group.size())):
            out = self.reduce(torch.cat([t.reshape(-1) for t in inputs]), numel, group)
            if callback_fn is not None:
                callback_fn(out.view(first.shape))
            return
        bucket = self.bucket(first, group)
        if numel > bucket.free:
            self.flush_bucket(bucket, making_room=True)
        self.add(bucket, inputs, callback_fn)

    def reduce(self, flat: torch.Tensor, numel: int, group) -> torch.Tensor:
        """Sum over the group of each member's `numel`-element part of `flat` (this rank's part)."""
        out = flat.new_empty(numel)
        _reduce_scatter(out, flat, group=group)
        return out

    def bucket(self, first: torch.Tensor, group) -> _Bucket:
        key = (first.dtype, first.device, group)
        if key not in self.buckets:
            self.buckets[key] = _Bucket(first.dtype, first.device, group, self.shard_size(first.dtype, group.size()))
        return self.buckets[key]

    def allocate(self, bucket: _Bucket) -> torch.Tensor:
        return torch.empty((bucket.group.size(), bucket.shard), dtype=bucket.dtype, device=bucket.device)

    def add(self, bucket: _Bucket, inputs, callback_fn) -> None:
        if bucket.data is None:
            bucket.data = self.allocate(bucket)
        numel = inputs[0].numel()
        for row, chunk in zip(bucket.data, inputs, strict=True):
            row[bucket.offset:bucket.offset + numel].copy_(chunk.reshape(-1))
        bucket.queue.append((callback_fn, bucket.offset, numel, inputs[0].shape))
        bucket.offset += numel

    def take(self, bucket: _Bucket, out: torch.Tensor, making_room: bool) -> list:
        """The queued entries this flush answers; the bucket starts empty again."""
        queue, bucket.queue, bucket.offset = bucket.queue, [], 0
        return queue

    def flush_bucket(self, bucket: _Bucket, making_room: bool = False) -> None:
        if not bucket.queue:
            return
        used = bucket.offset
        out = self.reduce(bucket.data[:, :used].contiguous().view(-1), used, bucket.group)
        self.deliver(self.take(bucket, out, making_room), out)

    def deliver(self, queue: list, out: torch.Tensor) -> None:
        for fn, start, numel, shape in queue:
            if fn is not None:
                fn(out[start:start + numel].view(shape))

    @torch.no_grad()
    def flush(self) -> None:
        for bucket in list(self.buckets.values()):
            self.flush_bucket(bucket)

    def teardown(self) -> None:
        for bucket in self.buckets.values():
            if bucket.queue:
                raise RuntimeError(f"teardown() with {len(bucket.queue)} reduce-scatter(s) queued: call flush() first")
            bucket.data = None


class Correct:
    name = "indep-bucketer-correct"
    area = "bucketer"
    version = "0"
    capabilities = frozenset({Capability.BUCKET_CAP, Capability.HALF_PRECISION})
    bucketer_class = Bucketer
    bug, clause, may_abort, dimension = "", "", False, ""

    def make(self, bucket_cap_mb):
        return self.bucketer_class() if bucket_cap_mb is None else self.bucketer_class(bucket_cap_mb)


def mutant(name: str, clause: str, dimension: str, bug: str, **kw):
    """Register a Bucketer subclass as mutant `name`, wrapped in an adapter class."""
    def adapter(bucketer_cls):
        return type(f"{bucketer_cls.__name__}Adapter", (Correct,), {"bucketer_class": bucketer_cls, "dimension": dimension})
    return MUTANTS.mutant(name, clause, f"[{dimension}] {bug}", adapter=adapter, **kw)


@mutant("late-binding-results", "B1", "when",
        "flush collects one lambda per callback over the loop variables: every callback of a flush reads the last "
        "entry's slice (Python's late binding)")
class LateBindingResults(Bucketer):
    def deliver(self, queue, out):
        self._fired(sum(fn is not None for fn, *_ in queue[:-1]) > 0)
        pending = []
        for fn, start, numel, shape in queue:
            pending.append((fn, lambda: out[start:start + numel].view(shape)))  # noqa: B023 - the bug
        for fn, result in pending:
            if fn is not None:
                fn(result())


@mutant("overflow-flush-keeps-queue", "B2", "how often",
        "the flush that makes room for an input that does not fit runs the queued callbacks but keeps them queued: "
        "they run again, on other columns, at the next flush")
class OverflowFlushKeepsQueue(Bucketer):
    def take(self, bucket, out, making_room):
        if making_room:
            self._fired(bool(bucket.queue))
            bucket.offset = 0
            return list(bucket.queue)
        return super().take(bucket, out, making_room)


@mutant("empty-bucket-stops-flush", "B2", "how often",
        "flush() returns at the first bucket with nothing queued (return for continue): buckets after an idle one "
        "are never flushed and their callbacks never run")
class EmptyBucketStopsFlush(Bucketer):
    @torch.no_grad()
    def flush(self):
        buckets = list(self.buckets.values())
        for i, bucket in enumerate(buckets):
            if not bucket.queue:
                self._fired(any(b.queue for b in buckets[i + 1:]))
                return
            self.flush_bucket(bucket)


@mutant("immediate-at-shard-size", "B5", "inputs",
        "an input of exactly one shard's size is reduced at once (>= for >): it overtakes smaller inputs queued "
        "before it in its bucket")
class ImmediateAtShardSize(Bucketer):
    def immediate(self, numel, shard):
        self._fired(numel == shard)
        return numel >= shard


@mutant("allreduce-global-rank", "B7", "who", may_abort=True,
        bug="reduce-scatter done as an all_reduce of the concatenation, keeping the part of the *global* rank: "
            "wrong (or a collective mismatch) on any group whose members' group ranks differ from their global ranks")
class AllreduceGlobalRank(Bucketer):
    def reduce(self, flat, numel, group):
        total = flat.clone()
        dist.all_reduce(total, group=group)
        r = dist.get_rank()
        self._fired(r != dist.get_rank(group))
        return total[r * numel:(r + 1) * numel].clone()


@mutant("bucket-default-dtype", "B12", "ambient",
        "the staging buffer is allocated with the default dtype (torch.empty without dtype=): non-float32 inputs "
        "come back as float32")
class BucketDefaultDtype(Bucketer):
    def allocate(self, bucket):
        self._fired(bucket.dtype != torch.get_default_dtype())
        return torch.empty((bucket.group.size(), bucket.shard), device=bucket.device)


@mutant("teardown-drops-queued", "B11", "end of life",
        "teardown() of a bucket still holding inputs frees it silently: their callbacks never run, nothing is raised")
class TeardownDropsQueued(Bucketer):
    def teardown(self):
        for bucket in self.buckets.values():
            self._fired(bool(bucket.queue))
            bucket.queue, bucket.offset, bucket.data = [], 0, None


@mutant("cap-per-rank", "B4", "inputs",
        "bucket_cap_mb read as the size of one rank's shard (not of the whole (W, shard) buffer): inputs between "
        "cap/W and cap are deferred instead of reduced at once")
class CapPerRank(Bucketer):
    def shard_size(self, dtype, group_size):
        return 0 if self.bucket_cap_mb <= 0 else int(self.bucket_cap_mb * _MiB // dtype.itemsize)

    def reduce_scatter_async(self, input_list, group, callback_fn=None):
        inputs = list(input_list)
        numel, dtype = inputs[0].numel(), inputs[0].dtype
        self._fired(super().shard_size(dtype, group.size()) < numel <= self.shard_size(dtype, group.size()))
        return super().reduce_scatter_async(inputs, group, callback_fn)


@mutant("empty-only-bucket-skipped", "B10", "inputs",
        "empty inputs are queued like the others and a flush skips a bucket whose offset is 0: a bucket holding "
        "only empty inputs never calls them back")
class EmptyOnlyBucketSkipped(Bucketer):
    @torch.no_grad()
    def reduce_scatter_async(self, input_list, group, callback_fn=None):
        inputs = list(input_list)
        if inputs[0].numel() == 0:
            self.add(self.bucket(inputs[0], group), inputs, callback_fn)
            return
        super().reduce_scatter_async(inputs, group, callback_fn)

    def flush_bucket(self, bucket, making_room=False):
        if bucket.offset == 0:
            self._fired(bool(bucket.queue))
            return
        super().flush_bucket(bucket, making_room)


@mutant("keyword-group-defaults-world", "B8", "inputs",
        "the call reads its arguments positionally with WORLD as the default group: group= given by keyword is ignored")
class KeywordGroupDefaultsWorld(Bucketer):
    def reduce_scatter_async(self, *args, **kwargs):
        input_list = args[0] if args else kwargs["input_list"]
        group = args[1] if len(args) > 1 else dist.group.WORLD
        self._fired(kwargs.get("group", group) is not group)
        callback_fn = args[2] if len(args) > 2 else kwargs.get("callback_fn")
        return super().reduce_scatter_async(input_list, group, callback_fn)


def correct() -> Correct:
    return Correct()


globals().update(MUTANTS.factories())
