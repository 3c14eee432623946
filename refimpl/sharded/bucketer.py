"""ReduceScatterBucketer: batch many small reduce-scatters into a few large ones.

Why: a reduce-scatter has a fixed per-call cost (a round of messages between every pair of
ranks, a kernel launch on GPU). Sharded data parallel reduce-scatters one gradient per
parameter; a model with hundreds of small parameters (biases, norms) would pay that cost
hundreds of times per backward. The bucketer copies small inputs side by side into a
per-(dtype, device, group) buffer and reduce-scatters the buffer once when it is full or on
``flush()``. Each caller gets its result through a callback.

[Note: bucket layout]
A bucket for a group of world size W is a ``(W, shard_size)`` buffer. Input ``i`` of
``reduce_scatter_async`` is a list of W equally shaped chunks; chunk ``r`` is copied, flattened,
into row ``r`` at the bucket's current offset. One reduce-scatter of the rows gives every rank
``r`` the sum over ranks of its row, and the columns ``[offset, offset + numel)`` of that
result are exactly the sum over ranks of chunk ``r`` of input ``i``. ``bucket_cap_mb`` is the
size of the whole ``(W, shard_size)`` buffer, so ``shard_size = cap / element_size / W``.

[Note: same call sequence on every rank]
Whether an input is bucketed, and when a bucket flushes, depends only on the shapes, dtypes
and order of the calls. Every rank of a group must therefore make the same calls in the same
order (as with any collective); the bucketer then issues the same collectives everywhere.

Collectives used: ``reduce_scatter_single`` (torch >= 2.10; earlier releases call the same
operation ``reduce_scatter_tensor``). Both are public names; the choice is made once, here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["StagingState", "ReduceScatterBucketer"]

# Public name of the "one input tensor, one output tensor" reduce-scatter. torch 2.10 renamed
# ``reduce_scatter_tensor`` to ``reduce_scatter_single`` and deprecated the old name; the
# name is kept for a torch without the new one. Looked up at each call, by name on
# ``torch.distributed``, so that refimpl.device_check sees it.
def _reduce_scatter_single(output: Tensor, input: Tensor, *, group) -> None:
    if hasattr(dist, "reduce_scatter_single"):
        dist.reduce_scatter_single(output, input, group=group)
    else:
        dist.reduce_scatter_tensor(output, input, group=group)

_MiB = 1024 * 1024

ProcessGroup = dist.ProcessGroup
Callback = Callable[[Tensor], object]


class StagingState(enum.Enum):
    """Lifecycle of one staging buffer (the bucket of one (dtype, device, group) key).

    UNALLOCATED -> (first input or setup) -> EMPTY -> (input) -> FILLING -> (flush) -> EMPTY
    EMPTY -> (teardown) -> UNALLOCATED.   Teardown of a FILLING bucket is an error: it would
    drop results that callers are waiting for.
    """

    UNALLOCATED = "unallocated"  # no storage held (before first use, after teardown)
    EMPTY = "empty"  # storage held, nothing queued
    FILLING = "filling"  # some inputs copied in, their callbacks pending until flush


class _StagingBuffer:
    """One ``(world_size, shard_size)`` staging buffer for a (dtype, device, group) key."""

    def __init__(self, dtype: torch.dtype, device: torch.device, group: ProcessGroup,
                 shard_size: int) -> None:
        self.dtype = dtype
        self.device = device
        self.group = group
        self.world_size = group.size()
        self.shard_size = shard_size
        self.data: Tensor | None = None
        self.offset = 0
        self.callbacks: list[tuple[Callback | None, int, torch.Size]] = []

    @property
    def state(self) -> StagingState:
        if self.data is None:
            return StagingState.UNALLOCATED
        return StagingState.FILLING if self.offset else StagingState.EMPTY

    @property
    def free(self) -> int:
        return self.shard_size - self.offset

    def nbytes(self) -> int:
        if self.data is None:
            return 0
        return self.data.untyped_storage().nbytes()

    def setup(self) -> None:
        if self.data is None:
            # Uninitialised is fine: only the columns [0, offset) are ever communicated, and
            # every one of them is written by an input before that.
            self.data = torch.empty((self.world_size, self.shard_size), dtype=self.dtype,
                                    device=self.device)

    def teardown(self) -> None:
        assert self.state is not StagingState.FILLING, (
            f"teardown() with {len(self.callbacks)} reduce-scatter(s) still queued in the "
            f"{self.dtype} bucket: their callbacks would never run. Call flush() first.")
        self.data = None

    def add(self, inputs: Sequence[Tensor], callback: Callback | None) -> None:
        numel = inputs[0].numel()
        assert numel <= self.free, "internal: caller must flush a bucket that cannot fit the input"
        self.setup()
        assert self.data is not None
        for row, chunk in zip(self.data, inputs, strict=True):
            row[self.offset:self.offset + numel].copy_(chunk.reshape(-1))
        self.offset += numel
        self.callbacks.append((callback, numel, inputs[0].shape))

    def flush(self) -> int:
        """Reduce-scatter the filled columns, then run the callbacks in insertion order.

        Returns the number of collectives issued (0 or 1).
        """
        if self.state is not StagingState.FILLING:
            assert not self.callbacks, "internal: callbacks queued in an empty bucket"
            return 0
        assert self.data is not None
        used = self.offset
        # A fresh output per flush: callbacks receive views of it and may keep them after the
        # flush (e.g. as a .grad), so it must not be reused by the next flush.
        output = self.data.new_empty(used)
        rows = self.data if used == self.shard_size else self.data[:, :used].contiguous()
        # Flattened rows = the concatenation of per-rank inputs (gloo accepts only that form).
        _reduce_scatter_single(output, rows.view(-1), group=self.group)
        callbacks, self.callbacks, self.offset = self.callbacks, [], 0
        start = 0
        for fn, numel, shape in callbacks:
            if fn is not None:
                fn(output[start:start + numel].view(shape))
            start += numel
        return 1


class ReduceScatterBucketer:
    """Bucket small reduce-scatters into larger ones; deliver results through callbacks.

    ``reduce_scatter_async(input_list, group, callback_fn)`` takes ``group.size()`` equally
    shaped tensors; rank ``r`` receives the sum over all ranks of ``input_list[r]``.

    Callback order (the surprising part): callbacks are **not** called in submission order.

    * Inputs that fit in a bucket's shard are queued; their callbacks run when that bucket
      flushes — when a later input would overflow it, or on ``flush()`` — in the order the
      inputs were queued *within that bucket*.
    * An input larger than a bucket shard (or any input when ``bucket_cap_mb <= 0``) is
      reduce-scattered at once and its callback runs before ``reduce_scatter_async``
      returns — ahead of smaller inputs queued earlier.
    * Buckets are keyed by (dtype, device, group); ``flush()`` flushes them in the order the
      keys were first used, so callbacks of different dtypes interleave by bucket, not by call.

    Only after ``flush()`` is every callback guaranteed to have run.

    Usage::

        bucketer = ReduceScatterBucketer(bucket_cap_mb=1)   # world size 2: 0.5 MiB per shard
        W = group.size()
        small = [torch.ones(10) for _ in range(W)]           # fits: queued
        big = [torch.ones(1 << 20) for _ in range(W)]        # 4 MiB > shard: reduced now
        bucketer.reduce_scatter_async(small, group, lambda out: print("small"))
        bucketer.reduce_scatter_async(big, group, lambda out: print("big"))
        bucketer.reduce_scatter_async(small, group, lambda out: print("small2"))
        bucketer.flush()
        # Prints (note: "big" first, although submitted second):
        # big
        # small
        # small2

    Memory: a bucket allocates ``bucket_cap_mb`` of staging memory on first use. Call
    ``teardown()`` between backward passes to free it (``memory_bytes()`` is then 0);
    ``setup()`` re-allocates known buckets ahead of time, otherwise the next input does.

    Args:
        bucket_cap_mb: size of one bucket (all ranks' shards together) in MiB. Values <= 0
            disable bucketing: every input is reduce-scattered immediately.
    """

    def __init__(self, bucket_cap_mb: float = 25) -> None:
        self.bucket_cap_mb = bucket_cap_mb
        self._buckets: dict[tuple[torch.dtype, torch.device, ProcessGroup], _StagingBuffer] = {}
        # Counters that tests and benchmarks read; they never influence behaviour.
        self.num_collectives = 0
        self.num_unbucketed = 0

    def shard_size(self, dtype: torch.dtype, world_size: int) -> int:
        """Elements of ``dtype`` one rank's shard of a bucket holds (0: bucketing disabled)."""
        if self.bucket_cap_mb <= 0:
            return 0
        element_size = dtype.itemsize
        return int(self.bucket_cap_mb * _MiB // element_size // world_size)

    @torch.no_grad()
    def reduce_scatter_async(self, input_list: Sequence[Tensor], group: ProcessGroup,
                             callback_fn: Callback | None = None) -> None:
        """Queue a reduce-scatter of ``input_list``; call ``callback_fn(result)`` later.

        ``result`` has the shape of ``input_list[0]`` and holds the sum over ranks of
        ``input_list[group.rank()]``. It may be a view into a buffer shared with other
        results: copy it if you modify it in place and need the others intact. The inputs
        are copied (or communicated) before this returns, so callers may reuse them.

        Every rank of ``group`` must make the same sequence of calls (shapes, dtypes, order).
        """
        if group is None:
            raise TypeError("reduce_scatter_async needs an explicit process group "
                            "(for the default group pass torch.distributed.group.WORLD)")
        world_size = group.size()
        inputs = list(input_list)
        assert len(inputs) == world_size, (
            f"reduce_scatter_async got {len(inputs)} tensors but the group has "
            f"{world_size} ranks: pass one chunk per rank")
        first = inputs[0]
        for i, t in enumerate(inputs[1:], 1):
            assert (t.shape, t.dtype, t.device) == (first.shape, first.dtype, first.device), (
                f"input_list[{i}] is {tuple(t.shape)}/{t.dtype}/{t.device} but input_list[0] "
                f"is {tuple(first.shape)}/{first.dtype}/{first.device}: every chunk must match")

        numel = first.numel()
        if numel == 0:
            # Nothing to communicate; every rank takes this branch (same shapes everywhere).
            if callback_fn is not None:
                callback_fn(first.new_empty(first.shape))
            return

        if numel > self.shard_size(first.dtype, world_size):
            # Too big to share a bucket with anything: reduce it on its own, now.
            output = first.new_empty(numel)
            flat_inputs = torch.cat([t.reshape(-1) for t in inputs])
            _reduce_scatter_single(output, flat_inputs, group=group)
            output = output.view(first.shape)
            self.num_collectives += 1
            self.num_unbucketed += 1
            if callback_fn is not None:
                callback_fn(output)
            return

        bucket = self._bucket(first, group)
        if numel > bucket.free:
            self.num_collectives += bucket.flush()  # make room; runs the queued callbacks
        bucket.add(inputs, callback_fn)

    @torch.no_grad()
    def flush(self) -> None:
        """Reduce-scatter every partially filled bucket and run all pending callbacks."""
        for bucket in self._buckets.values():
            self.num_collectives += bucket.flush()

    def setup(self) -> None:
        """Allocate the buffers of every bucket used so far (optional: first use allocates)."""
        for bucket in self._buckets.values():
            bucket.setup()

    def teardown(self) -> None:
        """Free every bucket buffer, e.g. between backward passes. Requires an empty queue."""
        for bucket in self._buckets.values():
            bucket.teardown()

    def memory_bytes(self) -> int:
        """Bytes of staging memory the buckets hold right now (0 after ``teardown()``)."""
        return sum(bucket.nbytes() for bucket in self._buckets.values())

    def states(self) -> dict[tuple[torch.dtype, torch.device, ProcessGroup], StagingState]:
        """The lifecycle state of each bucket, for debugging and tests."""
        return {key: bucket.state for key, bucket in self._buckets.items()}

    def _bucket(self, tensor: Tensor, group: ProcessGroup) -> _StagingBuffer:
        key = (tensor.dtype, tensor.device, group)
        bucket = self._buckets.get(key)
        if bucket is None:
            shard = self.shard_size(tensor.dtype, group.size())
            bucket = self._buckets[key] = _StagingBuffer(tensor.dtype, tensor.device, group, shard)
        return bucket
