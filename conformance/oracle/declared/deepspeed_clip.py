"""DeepSpeed's `gradient_clipping`, replayed op for op on the oracle's averaged gradients.

torch's `clip_grad_norm_` (the oracle's default) and DeepSpeed compute the same global L2 norm
in different orders and scale by it differently, so their parameters drift 1 ulp apart after a
few clipped steps. Neither is wrong: it is a declared difference (`Semantics.clipping`), and the
oracle replays DeepSpeed's arithmetic with the same torch ops on the same pieces, so the engine
is still judged bitwise. Only the value of the norm's inputs comes from the oracle; every
rounding step is DeepSpeed 0.19's:

- stage 0 (`deepspeed.runtime.utils.clip_grad_norm_`, fp32 without a ZeRO optimizer): one norm
  per parameter (`p.grad.float().norm(2)`), `stack(norms).pow(2).sum()`, `pow(1/2)`, then
  `norm * 1.0 / W` all-reduced over the data-parallel group (the mean of W equal norms) and
  `grad *= min(1, max_norm / (norm + 1e-6))`;
- ZeRO 1/2 (`DeepSpeedZeroOptimizer.step`): each rank takes the fp64 norms of the gradient
  pieces in its own partition of the flat, padded parameter group (`get_grad_norm_direct` over
  `averaged_gradients`), sums them, the ranks' sums are all-reduced, `pow(1/2)`, combined over
  the (one) parameter group with `vector_norm` (`combine_grad_norm_groups`), and
  `unscale_and_clip_grads` multiplies by `1 / clamp(((norm / loss_scale) + 1e-6) / max_norm, min=1)`;
- ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3.step`): the same, over each parameter's own partition
  (every parameter is split across the ranks on its own), with the norm kept in fp64 to the end.

Which ranks' partial sums meet in which order matters from 3 ranks on (gloo's all-reduce
order), so the replay is bitwise for 1-2 ranks only (`exact_for`). From 3 ranks the clipped step
is judged against the bound `conformance.oracle.clip_bound` derives for any evaluation order of the
global norm (its conditions hold for every rule here: each squared element is rounded through
at most N + 16 roundings no coarser than fp32 — the fp64 pieces' roundings are each 2**-29 of an
fp32 one, then the partial sum's `.float()`, the W - 1 additions of the all-reduce and the
`vector_norm` of one group's norm (a square and a root); the coefficient takes 3 roundings (the
1e-6 addition, the division by max_norm, the reciprocal), within the bound's four). An engine
that clips by one rank's partition alone (a local norm) lands far outside it
(tests/conformance/test_deepspeed_clip.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

STAGE0_SOURCE = ("deepspeed/runtime/utils.py clip_grad_norm_ (engine.clip_fp32_gradients): "
                 "stack(norms).pow(2).sum().pow(1/2), norm*1.0/W all-reduced, grad *= min(1, max/(norm+1e-6))")
ZERO12_SOURCE = ("deepspeed/runtime/zero/stage_1_and_2.py step: get_grad_norm_direct over each rank's partition "
                 "pieces (fp64 norms, stack(norms).pow(2).sum().float(), all-reduced, pow(1/2)), combine_grad_norm_groups, "
                 "unscale_and_clip_grads: grad *= 1/clamp(((norm/loss_scale)+1e-6)/max_norm, min=1)")
ZERO3_SOURCE = ("deepspeed/runtime/zero/stage3.py step: get_grad_norm_direct over each parameter's own partition "
                "(fp64 norms, torch.sum(torch.pow(stack, 2)), all-reduced, ** (1/2), kept fp64), "
                "combine_grad_norm_groups, unscale_and_clip_grads: fp32 grad *= 1/(clamp(((norm/S)+1e-6)/max, min=1)*S)")
BOUND_SOURCE = ("from 3 ranks gloo picks the order the ranks' partial norms are added in: the clipped step is judged "
                "within the bound conformance.oracle.clip_bound derives for any evaluation order of the global norm")
ALIGNMENT = 2  # stage_1_and_2.py: nccl_start_alignment_factor (4-byte alignment / sizeof(fp16))
NORM_DTYPE = torch.float64  # deepspeed/runtime/zero/utils.py get_norm_dtype(): fp64 wherever the device has it


def exact_for(world_size: int) -> bool:
    """Whether the replay is bitwise for `world_size` ranks: a sum of two partial norms has one order."""
    return world_size <= 2


def _allreduce_sum(parts: list[Tensor]) -> Tensor:
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def stage0(grads: list[Tensor], max_norm: float, world_size: int) -> None:
    """`deepspeed.runtime.utils.clip_grad_norm_` on the (replicated) gradients, in place."""
    norms = [g.detach().float().norm(2.0) for g in grads]
    total = torch.stack(norms).pow(2.0).sum().float().pow(1.0 / 2.0)
    scaled = total * 1.0 / float(world_size)
    total = _allreduce_sum([scaled] * world_size)
    coef = torch.tensor([float(max_norm)]) / (total + 1e-6)
    coef = torch.min(torch.tensor([1.0]), coef)
    for g in grads:
        g.mul_(coef)


def partition_pieces(grads: list[Tensor], world_size: int) -> list[list[Tensor]]:
    """Each rank's pieces of the flat parameter group, as ZeRO 1/2 partition it (padding excluded).

    The group is flattened in parameter order and padded to a multiple of ALIGNMENT·W; rank r
    owns [r·P, (r+1)·P) with P = padded size / W, and holds, per parameter overlapping that
    range, the 1-D slice of its gradient that falls inside (`get_flat_partition`).
    """
    total = sum(g.numel() for g in grads)
    unit = ALIGNMENT * world_size
    padded = math.ceil(total / unit) * unit
    size = padded // world_size
    pieces: list[list[Tensor]] = []
    for r in range(world_size):
        lo, hi, start, mine = r * size, (r + 1) * size, 0, []
        for g in grads:
            end = start + g.numel()
            a, b = max(lo, start), min(hi, end)
            if a < b:
                mine.append(g.detach().contiguous().view(-1).narrow(0, a - start, b - a))
            start = end
        pieces.append(mine)
    return pieces


def zero12(grads: list[Tensor], max_norm: float, world_size: int, loss_scale: float = 1.0) -> None:
    """ZeRO 1/2's norm and `unscale_and_clip_grads` on the (replicated) gradients, in place."""
    partial = []
    for mine in partition_pieces(grads, world_size):
        norms = [torch.linalg.vector_norm(p.to(NORM_DTYPE), ord=2.0) for p in mine]
        partial.append(torch.stack(norms).pow(2.0).sum().float() if norms else torch.tensor(0.0))
    norm = _allreduce_sum(partial).pow(1.0 / 2.0)
    norm = torch.linalg.vector_norm(torch.stack([norm]), ord=2)  # combine_grad_norm_groups, one group
    clip = ((norm / loss_scale) + 1e-6) / max_norm
    combined = torch.clamp(clip, min=1.0) * loss_scale
    for g in grads:
        g.mul_(1.0 / combined)


def zero3(grads: list[Tensor], max_norm: float, world_size: int, loss_scale: float = 1.0) -> None:
    """ZeRO-3's norm and `unscale_and_clip_grads` on the (replicated) gradients, in place.

    Stage 3 partitions every parameter on its own: rank r holds chunk r of its flattened gradient,
    ceil(numel / W) elements, zero-padded at the end (`ds_tensor`). The norm stays fp64 throughout
    (`torch.sum(torch.pow(torch.stack(norms), 2))`, all-reduced, `** (1/2)`), and the fp32
    gradients are multiplied by the fp64 coefficient `1 / (clamp(((norm/S)+1e-6)/max, min=1)·S)`.
    """
    partial = []
    for r in range(world_size):
        norms = []
        for g in grads:
            flat = g.detach().reshape(-1)
            size = math.ceil(flat.numel() / world_size)
            chunk = torch.zeros(size, dtype=flat.dtype)
            piece = flat[r * size:(r + 1) * size]
            chunk[:piece.numel()] = piece
            norms.append(chunk.to(NORM_DTYPE).norm(2.0))
        partial.append(torch.sum(torch.pow(torch.stack(norms), 2.0)))
    norm = _allreduce_sum(partial) ** (1.0 / 2.0)
    norm = torch.linalg.vector_norm(torch.stack([norm]), ord=2)  # combine_grad_norm_groups, one sub-group
    clip = torch.clamp(((norm / loss_scale) + 1e-6) / max_norm, min=1.0)
    combined = clip * loss_scale
    for g in grads:
        g.mul_(1.0 / combined)


@dataclass(frozen=True)
class Clipping:
    """A declared clipping rule (`Semantics.clipping`): `apply(grads, max_norm, world_size)` in place."""

    name: str
    apply: Callable[[list[Tensor], float, int], None]
    source: str

    def describe(self) -> str:
        return f"{self.name} ({self.source})"

    def exact(self, world_size: int) -> bool:
        """Whether replaying this rule is bitwise at `world_size` ranks; else the derived bound judges."""
        return exact_for(world_size)


STAGE0 = Clipping("deepspeed-stage0", stage0, STAGE0_SOURCE)
ZERO12 = Clipping("deepspeed-zero12", zero12, ZERO12_SOURCE)
ZERO3 = Clipping("deepspeed-zero3", zero3, ZERO3_SOURCE)
