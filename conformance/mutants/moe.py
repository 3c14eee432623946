"""Mutants written from mixture-of-experts bug reports, caught by the MoE scenarios
(`conformance/catalogue/realistic.py`, model `moe`: top-2 of 8 experts, an aux loss, experts
left without a token on some ranks and steps).

Each is `BucketedDDP` with one bug and calls `self._fired()` only where the bug changed a value
the correct base would have produced:

- `ExpertWrongGroup`: expert gradients averaged over the expert-data-parallel group of a
  2-way expert-parallel layout (W/2 ranks) although every rank holds every expert and
  contributed a share (pytorch#167178, Megatron-LM#5956, DeepSpeed#6546 class);
- `UnusedExpertLeftOut`: an expert that got no token on some rank is averaged over the ranks
  that used it only, instead of all W with zero from the idle ones (pytorch#158719,
  torchtitan#2747 class);
- `AuxLossScaledTwice`: the engine hands the MoE layers' aux-loss auto-scaler the
  data-parallel factor 1/W (as Megatron-LM hands it its loss scale), and its all-reduce then
  averages again: the aux gradient is (1/W)² (Megatron-LM#3769, NeMo-Automodel#1408 class).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from conformance.mutants.base import BucketedDDP

EXPERT_PARALLEL = 2  # the expert-parallel size ExpertWrongGroup believes in


def _is_expert(name: str) -> bool:
    return ".experts." in name


class ExpertWrongGroup(BucketedDDP):
    bug = "expert gradients averaged over the expert-data-parallel group (W/2 ranks), not all W ranks"

    def __init__(self, module: nn.Module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        self._experts = {id(p) for n, p in module.named_parameters() if _is_expert(n)}

    def _local_grad(self, p: nn.Parameter, grad: Tensor | None) -> Tensor | None:
        group = max(1, self.world_size // EXPERT_PARALLEL)
        if grad is None or id(p) not in self._experts or group == self.world_size:
            return grad
        if bool(grad.any()):
            self._fired()
        return grad * (self.world_size / group)  # the base divides by W: the share ends divided by W/2


class UnusedExpertLeftOut(BucketedDDP):
    bug = "a parameter idle on some rank (an expert no token reached) is averaged over the ranks that used it only"

    def _prepare_for_backward(self, out) -> None:
        super()._prepare_for_backward(out)
        self._users = None
        if self.find_unused_parameters:
            uses = self._graph_uses(out)
            used = torch.tensor([float(id(p) in uses or p.grad is not None) for p in self._params])
            dist.all_reduce(used, group=self.group)  # every rank, same order: no collective mismatch
            self._users = {id(p): int(u) for p, u in zip(self._params, used.tolist(), strict=True)}

    def _finalize(self) -> None:
        super()._finalize()
        if not self._users:
            return
        with torch.no_grad():
            for p in self._params:
                users = self._users[id(p)]
                if 0 < users < self.world_size and p.grad is not None:
                    p.grad.mul_(self.world_size / users)
                    if bool(p.grad.any()):
                        self._fired()


class AuxLossScaledTwice(BucketedDDP):
    bug = "the MoE aux loss's gradient scaled by 1/W in the model and again by the all-reduce's average"

    def __init__(self, module: nn.Module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        self._scaled = [m for m in module.modules() if hasattr(m, "aux_loss_scale")]
        for m in self._scaled:
            m.aux_loss_scale = 1.0 / self.world_size

    def forward(self, *inputs, **kwargs):
        if self._scaled and self.world_size > 1 and torch.is_grad_enabled():
            self._fired()  # every aux loss's gradient is 1/W of what the rank's loss gives it
        return super().forward(*inputs, **kwargs)
