"""Backward timing records of the reducer, as plain data for reports and benchmarks.

All times are nanoseconds relative to ``prepare_for_backward`` of the iteration (the end of
the synced forward), like PyTorch's ``Reducer::get_backward_stats``. A report can draw a
bucket timeline from them: one bar per bucket from ``launch_ns`` to ``finish_ns``, the dots
of ``param_ready_ns`` under it, and a line at ``backward_end_ns``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BackwardStats", "BucketTiming", "backward_stats"]


@dataclass(frozen=True)
class BucketTiming:
    index: int
    param_indices: tuple[int, ...]
    nbytes: int
    launch_ns: int | None  # when its collective was issued
    finish_ns: int | None  # when the collective's future completed


@dataclass(frozen=True)
class BackwardStats:
    param_names: tuple[str, ...]
    param_ready_ns: tuple[int | None, ...]  # None: no gradient arrived (unused)
    buckets: tuple[BucketTiming, ...]
    backward_end_ns: int | None  # when autograd finished (the queued finalize started)
    finalize_end_ns: int | None  # when every .grad held its average

    def comm_ns(self) -> int:
        """Wall time during which at least one bucket's collective was in flight."""
        return _union_length(self._intervals(None))

    def overlapped_comm_ns(self) -> int:
        """The part of ``comm_ns`` that ran while backward was still computing."""
        if self.backward_end_ns is None:
            return 0
        return _union_length(self._intervals(self.backward_end_ns))

    def overlap_fraction(self) -> float:
        """Share of communication hidden behind backward (0 when there was none)."""
        total = self.comm_ns()
        return self.overlapped_comm_ns() / total if total else 0.0

    def _intervals(self, clip: int | None) -> list[tuple[int, int]]:
        out = []
        for b in self.buckets:
            if b.launch_ns is None or b.finish_ns is None:
                continue
            end = b.finish_ns if clip is None else min(b.finish_ns, clip)
            if end > b.launch_ns:
                out.append((b.launch_ns, end))
        return out

    def as_dict(self) -> dict:
        return {
            "param_names": list(self.param_names),
            "param_ready_ns": list(self.param_ready_ns),
            "buckets": [b.__dict__.copy() | {"param_indices": list(b.param_indices)} for b in self.buckets],
            "backward_end_ns": self.backward_end_ns,
            "finalize_end_ns": self.finalize_end_ns,
        }


def backward_stats(names, ready_ns, buckets, base_ns: int, finalize_start_ns: int, finalize_end_ns: int) -> BackwardStats:
    """Turn the reducer's raw clock readings (``perf_counter_ns``; -1: never) into stats."""

    def since(t: int, floor: int = 0) -> int | None:
        return t - base_ns if t >= floor else None

    return BackwardStats(
        param_names=tuple(names),
        param_ready_ns=tuple(t if t >= 0 else None for t in ready_ns),
        buckets=tuple(
            BucketTiming(
                index=b.index,
                param_indices=b.plan.param_indices,
                nbytes=b.plan.nbytes,
                launch_ns=since(b.launch_ns),
                finish_ns=since(b.finish_cell[0]),
            )
            for b in buckets
        ),
        backward_end_ns=since(finalize_start_ns, base_ns),  # -1 or a previous iteration's: None
        finalize_end_ns=since(finalize_end_ns, base_ns),
    )


def _union_length(intervals: list[tuple[int, int]]) -> int:
    total, cur_start, cur_end = 0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total
