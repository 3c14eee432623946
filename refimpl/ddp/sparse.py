"""Summing a sparse (COO) gradient across ranks by all-gather.

A sparse gradient (``nn.Embedding(sparse=True)``) touches a rank-dependent set of rows, so
it cannot be all-reduced as a flat buffer. Each rank instead gathers every rank's
(indices, values), concatenates them and lets ``coalesce()`` sum duplicate rows. Gloo's
``all_gather`` needs equal sizes, hence two phases: first the ``nnz`` counts are exchanged
(launched asynchronously when the bucket is ready), then the padded indices/values are
gathered (when the reducer finalizes) and the padding is trimmed off.

Every rank runs the same sequence of collectives (count gather at launch, data gathers at
finalize, in bucket order), which is what keeps the group's collective streams aligned.
The bucket's ``launch`` scales each rank's gradient by 1/W before it is gathered, like every
other gradient; the result is the sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["SparseAllGatherReduction"]


class SparseAllGatherReduction:
    """One in-flight sparse reduction; ``result()`` returns the summed sparse tensor."""

    def __init__(
        self,
        grad: torch.Tensor | None,
        like: torch.Tensor,
        group: dist.ProcessGroup,
    ) -> None:
        if grad is None:
            # A rank that did not use the embedding still takes part, with nothing to add.
            grad = torch.sparse_coo_tensor(
                torch.empty((1, 0), dtype=torch.long, device=like.device),
                torch.empty((0, *like.shape[1:]), dtype=like.dtype, device=like.device),
                like.shape,
            )
        elif not grad.is_sparse:
            raise RuntimeError(
                "a parameter planned for a sparse bucket produced a dense gradient; "
                "build the module with the same `sparse=` setting on every rank"
            )
        grad = grad.coalesce()
        self._shape = grad.shape
        self._indices = grad.indices()
        self._values = grad.values()
        self._group = group
        self._world_size = world_size = dist.get_world_size(group)
        nnz = torch.tensor([self._indices.shape[1]], dtype=torch.long, device=like.device)
        self._counts = [torch.empty_like(nnz) for _ in range(world_size)]
        self._count_work = dist.all_gather(self._counts, nnz, group=group, async_op=True)

    def result(self) -> torch.Tensor:
        self._count_work.wait()
        counts = [int(c.item()) for c in self._counts]
        width = max(counts)
        nnz = self._indices.shape[1]
        indices = self._indices
        values = self._values
        if nnz < width:
            indices = torch.cat([indices, indices.new_zeros((indices.shape[0], width - nnz))], 1)
            values = torch.cat([values, values.new_zeros((width - nnz, *values.shape[1:]))], 0)
        all_indices = [torch.empty_like(indices) for _ in range(self._world_size)]
        all_values = [torch.empty_like(values) for _ in range(self._world_size)]
        dist.all_gather(all_indices, indices.contiguous(), group=self._group)
        dist.all_gather(all_values, values.contiguous(), group=self._group)
        return torch.sparse_coo_tensor(
            torch.cat([t[:, :c] for t, c in zip(all_indices, counts, strict=True)], 1),
            torch.cat([t[:c] for t, c in zip(all_values, counts, strict=True)], 0),
            self._shape,
        ).coalesce()
