"""`deepspeed-zero0`: DeepSpeed's engine without ZeRO (stage 0), owning backward and the step.

Stage 0 is DeepSpeed's plain data parallelism, and the one stage that needs its own backward:
`engine.backward(loss)` scales the loss for gradient accumulation and all-reduces at the
accumulation boundary; `engine.step()` counts micro-steps and steps the optimizer only at the
boundary. So the adapter owns "backward" and "optimizer" (protocol v2): the suite's micro-batches
are DeepSpeed's `gradient_accumulation_steps` (the scenario's micro-batches per step, passed as
`OptimizerSpec.micro_batches`), and `no_sync()` is not DeepSpeed's context manager but nothing at
all — the engine decides from its micro-step counter, as in a user's loop:

    for micro in range(gas):
        loss = engine(x)
        engine.backward(loss)   # all-reduce at the boundary only
        engine.step()           # optimizer step at the boundary only

Declared: micro-batches accumulate as a MEAN — DeepSpeed's documented gradient accumulation
divides the loss by `gradient_accumulation_steps` before backward (engine.backward,
`scale_wrt_gas=True`). The oracle divides each micro-batch's gradient instead; both are the same
bits when the count is a power of two, so other counts are skipped with that reason.
bf16 and fp16 run DeepSpeed's `bf16` / `fp16` config: fp32 masters, declared; fp16's dynamic loss
scaler, declared and replayed (conformance.oracle.declared.loss_scaler). What stage 0 + fp16 shows is a strict
xfail (the loss is never scaled, the gradients are still divided by the scale).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

from torch import Tensor, nn

from conformance.adapters.engines import probe, production_features
from conformance.adapters.engines.deepspeed import (
    FP16_SCALER,
    INSTALL,
    UNSUPPORTED,
    EngineStep,
    _cpu,
    clipped,
    engine_loop_limits,
    fp16_refused_here,
    initialize,
    load_engine_checkpoint,
    precision_config,
    save_engine_checkpoint,
)
from conformance.adapters.protocol import OptimizerSpec
from conformance.oracle.declared import deepspeed_clip, loss_scaler
from conformance.semantics import Accumulation, Precision, Scaling, Semantics
from conformance.spec import Capability as C

SEMANTICS = Semantics(
    accumulation=Accumulation.MEAN,
    scaling=Scaling.POST,
    sources=("DeepSpeed engine.backward: with gradient_accumulation_steps > 1 the loss is divided by "
             "gradient_accumulation_steps before backward (scale_wrt_gas=True); engine.step() steps at the "
             "accumulation boundary only",
             "DeepSpeed engine.allreduce_bucket (postscale_gradients, DeepSpeed's default): all_reduce the sum, then "
             "mul_(gradient_predivide_factor / dp_world_size), i.e. 1/W after the sum"),
)


FP16_SOURCE = ("DeepSpeed config 'fp16' without ZeRO: engine._do_optimizer_sanity_check picks FP16, an "
               "FP16_Optimizer over fp16 parameters with fp32 master copies and the dynamic loss scaler")
BF16_SOURCE = ("DeepSpeed config 'bf16': {'enabled': true} without ZeRO: engine._do_optimizer_sanity_check picks "
               "DDP_BFLOAT16, an FP16_UnfusedOptimizer over bf16 parameters with fp32 master copies (no loss scaling "
               "for bf16)")


class DeepSpeedStage0Wrapped:
    def __init__(self, engine):
        self.engine = engine
        self.module = engine.module
        self.optimizer = EngineStep(engine)

    def __call__(self, *inputs, **kwargs):
        return self.engine(*inputs, **kwargs)

    def no_sync(self):
        return contextlib.nullcontext()  # the engine's micro-step counter decides where the boundary is

    def backward(self, loss) -> None:
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.backward(loss)
        if not boundary:
            self.engine.step()  # a micro-step: counted, no optimizer step (DeepSpeed's loop calls it every micro-batch)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def checkpoint_state(self) -> str:
        return save_engine_checkpoint(self.engine, self.group)

    def load_checkpoint_state(self, path: str) -> None:
        load_engine_checkpoint(self.engine, self.group, path)

    def full_gradients(self) -> dict[str, Tensor | None]:
        return {n: _cpu(p.grad) for n, p in self.module.named_parameters() if p.requires_grad}

    def full_parameters(self) -> dict[str, Tensor]:
        return {n: _cpu(p) for n, p in self.module.named_parameters()}

    def full_buffers(self) -> dict[str, Tensor]:
        return {n: _cpu(b) for n, b in self.module.named_buffers()}

    def optimizer_parameters(self):
        return [p for p in self.module.parameters() if p.requires_grad]


class DeepSpeedStage0Adapter:
    name, area = "deepspeed-zero0", "ddp"
    owns = frozenset({"optimizer", "backward"})
    checkpoint_api = True  # engine.save_checkpoint / load_checkpoint
    capabilities = frozenset({C.NO_SYNC, C.FIND_UNUSED, C.BUFFER_BROADCAST, C.HALF_PRECISION})
    semantics = SEMANTICS

    def __init__(self):
        self.version, self._why = probe("deepspeed", "deepspeed", INSTALL)

    def semantics_for(self, scenario) -> Semantics:
        """bf16 parameters: DeepSpeed's `bf16` config, its optimizer steps fp32 master copies.
        fp32 with `gradient_clipping`: deepspeed.runtime.utils.clip_grad_norm_, replayed."""
        if scenario.dtype == "bfloat16":
            return replace(SEMANTICS, precision=Precision.FP32_MASTER, sources=(*SEMANTICS.sources, BF16_SOURCE))
        if scenario.dtype == "float16":
            return replace(SEMANTICS, precision=Precision.FP32_MASTER, loss_scaler=FP16_SCALER,
                           sources=(*SEMANTICS.sources, FP16_SOURCE, loss_scaler.SOURCE))
        if clipped(scenario):
            return replace(SEMANTICS, clipping=deepspeed_clip.STAGE0,
                           sources=(*SEMANTICS.sources, deepspeed_clip.STAGE0_SOURCE))
        return SEMANTICS

    def unavailable(self, scenario) -> str | None:
        if self._why:
            return self._why
        why = fp16_refused_here(scenario)
        if why:
            return why
        if scenario.optimizer == "none":
            return "DeepSpeed's engine needs an optimizer"
        why = engine_loop_limits(scenario)
        if why:
            return why
        mb = scenario.micro_batches
        if mb & (mb - 1):
            return (f"{mb} micro-batches: DeepSpeed divides the loss by gradient_accumulation_steps before backward, "
                    "the oracle divides each gradient; the same bits only for powers of two")
        if scenario.zero_grad == "alternate":
            return "engine.step() clears the gradients itself: zero_grad(set_to_none=False) has no engine equivalent"
        return production_features(scenario, UNSUPPORTED)

    def wrap(self, module: nn.Module, ctx, options, optimizer: OptimizerSpec | None = None) -> DeepSpeedStage0Wrapped:
        engine, _ = initialize(module, ctx, optimizer, {
            "gradient_accumulation_steps": optimizer.micro_batches,
            "zero_optimization": {"stage": 0},
            **precision_config(str(next(module.parameters()).dtype).removeprefix("torch.")),
        })
        wrapped = DeepSpeedStage0Wrapped(engine)
        wrapped.group = ctx.group
        return wrapped


def deepspeed_zero0() -> DeepSpeedStage0Adapter:
    return DeepSpeedStage0Adapter()
