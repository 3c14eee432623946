"""`deepspeed-zero1-fp32acc`: ZeRO-1 with bf16 parameters and `data_types.grad_accum_dtype: fp32`.

That configuration is the one DeepSpeed routes to its `BF16_Optimizer` instead of the ZeRO
optimizer (`engine._do_optimizer_sanity_check` returns BFLOAT16 for bf16 + ZeRO stage 1 + fp32
gradient accumulation), a different code path from `deepspeed-zero1`'s bf16 runs:

- every micro-batch's bf16 gradient (of loss / gradient_accumulation_steps) is added into a
  per-rank fp32 buffer in `BF16_Optimizer.backward_epilogue` (`update_hp_grads`), the bf16
  gradient cleared at the next backward's prologue;
- at the accumulation boundary the fp32 buffers are all-reduced (`allreduce_gradients`): cast to
  `communication_data_type` (bf16 by default for bf16 models), summed, scaled by 1/W and copied
  back into the fp32 buffers; the fp32 partitions step and are copied back to the bf16 parameters.

deepspeedai/DeepSpeed PR #7985 (merged 2026-04, bug in 0.18.6-0.18.10): `_backward_epilogue`
all-reduced *before* `optimizer.backward_epilogue()`, so the boundary micro-batch's gradient was
added to the local fp32 buffer after the reduction, silently left out of the average. The
oracle models the configuration exactly (declared `precision: fp32-master-fp32-accumulation`:
fp32 masters, micro-batch gradients cast to fp32 and summed per rank, the sums cast to bf16 and
averaged under the scenario's bf16 rule),
so a DeepSpeed with the bug fails at the first synced backward (the boundary's gradient is not
the average), whatever the number of micro-batches. Gradients are read where BF16_Optimizer
keeps them, each parameter's view of the fp32 buffer (`_hp_grad`): the rank's own running sum
between boundaries, the all-reduced average at the boundary.

Other dtypes take `deepspeed-zero1`'s path unchanged (BF16_Optimizer is for bf16 parameters
only), so they are skipped here with that reason rather than run twice.
"""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from conformance.adapters.engines.deepspeed import (
    DeepSpeedAdapter,
    DeepSpeedEngineLoopWrapped,
    _cpu,
)
from conformance.semantics import Precision, Semantics

SOURCE = ("DeepSpeed config bf16 + zero_optimization.stage 1 + data_types.grad_accum_dtype 'fp32': "
          "engine._do_optimizer_sanity_check picks BFLOAT16 (runtime/bf16_optimizer.py BF16_Optimizer): "
          "update_hp_grads adds each micro-batch's bf16 gradient into an fp32 buffer, allreduce_gradients reduces the "
          "fp32 buffer at the boundary (after backward_epilogue since deepspeedai/DeepSpeed PR #7985), the fp32 "
          "partitions step")


class BF16OptimizerWrapped(DeepSpeedEngineLoopWrapped):
    def full_gradients(self) -> dict[str, Tensor | None]:
        """Each parameter's fp32 gradient where BF16_Optimizer keeps it (`lp._hp_grad`, a flat view of its buffer)."""
        out = {}
        for name, p in self._named():
            if p.requires_grad:
                hp = getattr(p, "_hp_grad", None)
                # at the boundary the all-reduced values, which went through bf16 (lossless back to the parameter's dtype)
                out[name] = None if hp is None else _cpu(hp.reshape(p.shape), None if self._local else p)
        return out


class DeepSpeedZero1Fp32Accumulation(DeepSpeedAdapter):
    extra_config = {"data_types": {"grad_accum_dtype": "fp32"}}
    loop_wrapped = BF16OptimizerWrapped

    def __init__(self):
        super().__init__(1)
        self.name = "deepspeed-zero1-fp32acc"

    def semantics_for(self, scenario) -> Semantics:
        sem = super().semantics_for(scenario)
        if scenario.dtype != "bfloat16":
            return sem
        return replace(sem, precision=Precision.FP32_MASTER_FP32_ACCUMULATION, sources=(*sem.sources, SOURCE))

    def unavailable(self, scenario) -> str | None:
        if not self._why and scenario.dtype != "bfloat16":
            return ("grad_accum_dtype fp32 selects BF16_Optimizer for bf16 parameters only; other dtypes run "
                    "deepspeed-zero1's path unchanged (judged there)")
        return super().unavailable(scenario)


def deepspeed_zero1_fp32acc() -> DeepSpeedZero1Fp32Accumulation:
    return DeepSpeedZero1Fp32Accumulation()
