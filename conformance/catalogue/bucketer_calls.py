"""The unit of a bucketer plan: one `reduce_scatter_async` call, and the shard rule both references share.

Kept apart from `conformance.catalogue.bucketer` so the plan kinds built elsewhere
(`conformance.catalogue.bucketer_space`, issue 38) use it without importing the catalogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MiB = 1024 * 1024
DEFAULT_CAP_MB = 25.0  # what both implementations use when no cap is given


@dataclass(frozen=True)
class Call:
    """One `reduce_scatter_async` call: chunk shape (every rank's chunk has it), dtype, callback?"""

    shape: tuple[int, ...]
    dtype: str
    callback: bool = True
    group: str = "world"  # "world" | "pairs" (ranks 0-1, 2-3, ...) | "self" (a group of one)
    layout: str = "contiguous"  # "contiguous" | "transposed" | "strided": same values, other strides
    only_round: int | None = None  # issue 30: made in this round only (None: every round)

    def active(self, round_: int) -> bool:
        return self.only_round is None or self.only_round == round_

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def shard_elements(cap_mb: float | None, dtype: str, world_size: int) -> int:
    """Elements of one rank's shard of a bucket (0: bucketing disabled). Same rule in both."""
    cap = DEFAULT_CAP_MB if cap_mb is None else cap_mb
    if cap <= 0:
        return 0
    itemsize = getattr(torch, dtype).itemsize
    return int(cap * MiB // itemsize // world_size)
