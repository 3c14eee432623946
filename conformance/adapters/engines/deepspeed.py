"""`deepspeed-zero1`, `deepspeed-zero2`, `deepspeed-zero3`: DeepSpeed's engine with ZeRO stage 1/2/3.

The engine owns the optimizer (protocol v2): `deepspeed.initialize` wraps the scenario's torch
optimizer in its ZeRO optimizer. In fp32 with one micro-batch per step everything else is the
user's plain loop — `loss.backward()`, `optimizer.zero_grad()`, `optimizer.step()` — which
DeepSpeed supports for ZeRO 1-3 (only stage 0 refuses a plain backward), and where a bug of the
plain loop shows. Gradients are read with `deepspeed.utils.safe_get_full_grad` (a collective for
the partitioned stages) before the step, parameters with `safe_get_full_fp32_param`.

DeepSpeed's own loop (`engine.backward(loss)`, `engine.step()` every micro-batch, as its docs
write it; the adapter then owns backward too, `owns_for`) where only it gives the engine's
semantics:
- `bf16` / `fp16` parameters: the config's `bf16` / `fp16` section (fp32 master partitions; fp16
  adds the dynamic loss scaler, which scales the loss inside `engine.backward` only, replayed by
  the oracle: `conformance.oracle.declared.loss_scaler`, `FP16_SCALER`);
- several micro-batches on ZeRO-2/3 (they have no `no_sync`): `gradient_accumulation_steps`,
  declared as a mean (`engine.backward` divides the loss by it), with the accumulation boundary
  the engine's micro-step counter. ZeRO-2/3 reduce every micro-batch into their gradient
  partitions, so between boundaries there is no per-rank gradient to read: declared
  (`MidAccumulation.REDUCED`), only the boundary's gradient is judged.

Configuration that would otherwise change what is computed, made explicit:
- `gradient_clipping` is the scenario's (0.0 without one: DeepSpeed's default 1.0 clips); the
  oracle clips the way ZeRO does (`conformance.oracle.declared.deepspeed_clip`);
- `zero_allow_untested_optimizer` (torch SGD / Adam); `LOCAL_RANK` from the rank;
- the shared-memory all-reduce op DeepSpeed JIT-compiles on CPU in every new process (minutes;
  it only serves inference all-reduce) is kept off: nothing is compiled at run time.

Declared: fp32 master weights for half-precision parameters, a mean over micro-batches where
the engine accumulates; every other difference from torch DDP is a finding (the xfail list).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import Tensor, nn

from conformance.adapters.engines import probe, production_features
from conformance.adapters.protocol import OptimizerSpec
from conformance.oracle.declared import deepspeed_clip, loss_scaler
from conformance.oracle.declared.loss_scaler import DynamicLossScale
from conformance.semantics import Accumulation, MidAccumulation, Precision, Semantics
from conformance.spec import Capability as C
from refimpl import _torch_compat

INSTALL = "DS_BUILD_OPS=0 pip install -c constraints.txt 'gradparity[deepspeed]'"
# The engine's documentation, for the production-training features it does its own way.
UNSUPPORTED = {
    "grad_scaler": "DeepSpeed scales the loss itself (config 'fp16': loss_scale / dynamic loss scaling); "
                   "torch's GradScaler is not applied to its optimizer",
    "freeze": "DeepSpeed's ZeRO optimizer flattens the trainable parameters at deepspeed.initialize; "
              "requires_grad changes afterwards are not supported",
}


HALF = ("float16", "bfloat16")


def fp16_refused_here(scenario) -> str | None:
    """DeepSpeed's CPU accelerator refuses an fp16 config at initialize ("Type fp16 is not supported on
    your device": engine.py _do_sanity_check) where oneDNN has no fp16 kernels on this CPU
    (cpu_accelerator.is_fp16_supported: torch.ops.mkldnn._is_mkldnn_fp16_supported()). That is this
    machine, not the engine's semantics: the case cannot run here, said as a skip, never a failure."""
    if scenario.dtype != "float16" or scenario.device != "cpu":
        return None
    if os.environ.get("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "") != "cpu":
        return None  # DeepSpeed picks the CUDA accelerator: fp16 is supported
    if _torch_compat.mkldnn_fp16_supported():
        return None
    return ("DeepSpeed's CPU accelerator refuses fp16 on this CPU (oneDNN without fp16: "
            "cpu_accelerator.is_fp16_supported, engine.py _do_sanity_check raises 'Type fp16 is not supported on your device')")
MEAN_SOURCE = ("DeepSpeed engine.backward: with gradient_accumulation_steps > 1 the loss is divided by "
               "gradient_accumulation_steps before backward (scale_wrt_gas=True); engine.step() steps at the "
               "accumulation boundary only")
MASTER_SOURCE = ("DeepSpeed config 'bf16' / 'fp16' with ZeRO: DeepSpeedZeroOptimizer (stage_1_and_2.py) / "
                 "DeepSpeedZeroOptimizer_Stage3 keep fp32 partitions of the half-precision parameters "
                 "(single_partition_of_fp32_groups / fp32_partitioned_groups_flat), step them and copy them back")
REDUCED_SOURCE = ("DeepSpeed ZeRO-2/3 reduce every micro-batch's gradient into their partitions "
                     "(reduce_independent_p_g_buckets_and_remove_grads / stage3 reduce_ready_partitions_and_remove_grads) "
                     "and release param.grad: no per-rank gradient exists between accumulation boundaries")


def _cpu(t: Tensor | None, like: Tensor | None = None) -> Tensor | None:
    """A CPU copy; a half-precision parameter's fp32 gradient (ZeRO's partitions) in the parameter's
    dtype when that cast is lossless, else as it is (then the dtype difference is reported)."""
    if t is None:
        return None
    t = t.detach().to("cpu", copy=True)
    if like is not None and like.dtype != t.dtype and like.dtype in (torch.float16, torch.bfloat16):
        cast = t.to(like.dtype)
        if torch.equal(cast.to(t.dtype), t):
            return cast
    return t


def driven_micro_batches(scenario) -> int:
    """The micro-batches per step the runner will drive: both loops (runners/ddp.py and
    runners/ddp_features.py) drive the scenario's count. The engine is configured from what is
    driven (OptimizerSpec.micro_batches), so the choice of loop must be made from it too."""
    return scenario.micro_batches


def engine_loop(stage: int, dtype: str, micro_batches: int) -> bool:
    """Whether DeepSpeed's own loop (engine.backward / engine.step) runs this configuration: half
    precision (its loss scaling lives in engine.backward), or accumulation on a stage without no_sync."""
    return dtype in HALF or (micro_batches > 1 and stage in (2, 3))


def _no_jit_shm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory all-reduce op (inference only)."""
    import importlib

    # By module name: `deepspeed.comm.torch` as an attribute is shadowed by `import torch` there.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def save_engine_checkpoint(engine, group) -> str:
    """DeepSpeed's own round trip, first half: `engine.save_checkpoint` into a directory every rank
    shares (rank 0 makes it and broadcasts the path); returns the path for `load_engine_checkpoint`."""
    import tempfile

    import torch.distributed as dist

    path = [tempfile.mkdtemp(prefix="gradparity-ds-") if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(path, src=dist.get_global_rank(group, 0), group=group)
    with contextlib.redirect_stdout(open(os.devnull, "w")):  # noqa: SIM115 - its progress lines
        engine.save_checkpoint(path[0], tag="gradparity")
    return path[0]


def load_engine_checkpoint(engine, group, path: str) -> None:
    """Second half: `engine.load_checkpoint` (module, optimizer and its ZeRO partitions), then rank 0
    removes the directory once every rank has read it."""
    import shutil

    import torch.distributed as dist

    with contextlib.redirect_stdout(open(os.devnull, "w")):  # noqa: SIM115
        engine.load_checkpoint(path, tag="gradparity")
    dist.barrier(group=group)
    if dist.get_rank(group) == 0:
        shutil.rmtree(path, ignore_errors=True)


class DeepSpeedWrapped:
    def __init__(self, engine, optimizer, stage: int):
        self.engine, self.optimizer, self.stage = engine, optimizer, stage
        self.module = engine.module

    def __call__(self, *inputs, **kwargs):
        return self.engine(*inputs, **kwargs)

    def no_sync(self):
        return self.engine.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def checkpoint_state(self) -> str:
        return save_engine_checkpoint(self.engine, self.group)

    def load_checkpoint_state(self, path: str) -> None:
        load_engine_checkpoint(self.engine, self.group, path)

    def _named(self):
        return [(n, p) for n, p in self.module.named_parameters()]

    def full_gradients(self) -> dict[str, Tensor | None]:
        from deepspeed.utils import safe_get_full_grad

        if self.engine.inside_no_sync_ctxt or getattr(self, "_local", False):
            return {n: _cpu(p.grad, p) for n, p in self._named() if p.requires_grad}
        return {n: _cpu(safe_get_full_grad(p), p) for n, p in self._named() if p.requires_grad}

    def full_parameters(self) -> dict[str, Tensor]:
        if self.stage == 3:
            import deepspeed

            params = [p for _, p in self._named()]
            with deepspeed.zero.GatheredParameters(params):
                return {n: _cpu(p) for n, p in self._named()}
        return {n: _cpu(p) for n, p in self._named()}

    def full_buffers(self) -> dict[str, Tensor]:
        return {n: _cpu(b) for n, b in self.module.named_buffers()}

    def optimizer_parameters(self):
        return [p for p in self.module.parameters() if p.requires_grad]


class EngineStep:
    """What the runner steps and zeroes in DeepSpeed's own loop: `engine.step()` (it zeroes the
    gradients itself at the boundary)."""

    def __init__(self, engine):
        self.engine = engine

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """engine.step() already cleared the gradients at the boundary."""

    def state_dict(self):
        return self.engine.optimizer.state_dict()


class DeepSpeedEngineLoopWrapped(DeepSpeedWrapped):
    """ZeRO 1-3 through DeepSpeed's own loop: every micro-batch `engine.backward(loss)` then, but at
    the boundary, `engine.step()` (a counted micro-step); the runner's step is the boundary's
    `engine.step()`. `no_sync()` is nothing: the engine's micro-step counter decides."""

    def __init__(self, engine, stage: int):
        super().__init__(engine, EngineStep(engine), stage)

    def no_sync(self):
        return contextlib.nullcontext()

    def backward(self, loss) -> None:
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.backward(loss)
        self._local = not boundary  # between boundaries: what the rank holds itself
        if not boundary:
            self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """engine.step() cleared the gradients at the boundary."""


class DeepSpeedAdapter:
    area = "ddp"
    owns = frozenset({"optimizer"})
    checkpoint_api = True  # engine.save_checkpoint / load_checkpoint (Wrapped.checkpoint_state)
    extra_config: dict = {}  # a configuration variant's keys (deepspeed_bf16_optimizer)
    loop_wrapped = DeepSpeedEngineLoopWrapped

    def __init__(self, stage: int):
        self.stage = stage
        self.name = f"deepspeed-zero{stage}"
        self.version, self._why = probe("deepspeed", "deepspeed", INSTALL)
        # NO_SYNC: ZeRO-1's own no_sync() in fp32; elsewhere micro-batches are the engine's
        # gradient_accumulation_steps (DeepSpeed: no_sync "incompatible with ZeRO stage 2/3").
        self.capabilities = frozenset({C.FIND_UNUSED, C.BUFFER_BROADCAST, C.ENGINE_ZERO_GRAD, C.NO_SYNC,
                                       C.HALF_PRECISION})

    def owns_for(self, scenario) -> frozenset[str]:
        if engine_loop(self.stage, scenario.dtype, driven_micro_batches(scenario)):
            return frozenset({"optimizer", "backward"})
        return self.owns

    def semantics_for(self, scenario) -> Semantics:
        sem, sources = {}, []
        if clipped(scenario):
            rule = deepspeed_clip.ZERO3 if self.stage == 3 else deepspeed_clip.ZERO12
            sem["clipping"] = rule
            sources.append(rule.source)
            if not rule.exact(scenario.world_size):
                sources.append(deepspeed_clip.BOUND_SOURCE)
        if not engine_loop(self.stage, scenario.dtype, driven_micro_batches(scenario)):
            return Semantics(**sem, sources=tuple(sources))
        if driven_micro_batches(scenario) > 1:
            sem["accumulation"] = Accumulation.MEAN
            sources.append(MEAN_SOURCE)
            if self.stage in (2, 3):
                sem["mid_accumulation"] = MidAccumulation.REDUCED
                sources.append(REDUCED_SOURCE)
        if scenario.dtype in HALF:
            sem["precision"] = Precision.FP32_MASTER
            sources.append(MASTER_SOURCE)
        if scenario.dtype == "float16":
            sem["loss_scaler"] = FP16_SCALER
            sources.append(loss_scaler.SOURCE)
        return Semantics(**sem, sources=tuple(sources))

    def unavailable(self, scenario) -> str | None:
        if self._why:
            return self._why
        why = fp16_refused_here(scenario)
        if why:
            return why
        if scenario.optimizer == "none":
            return "DeepSpeed's engine needs an optimizer"
        if engine_loop(self.stage, scenario.dtype, driven_micro_batches(scenario)):
            why = engine_loop_limits(scenario)
            if why:
                return why
        return production_features(scenario, UNSUPPORTED)

    def wrap(self, module: nn.Module, ctx, options, optimizer: OptimizerSpec | None = None) -> DeepSpeedWrapped:
        dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
        loop = engine_loop(self.stage, dtype, optimizer.micro_batches)
        engine, ds_optimizer = initialize(module, ctx, optimizer, {
            "gradient_accumulation_steps": optimizer.micro_batches if loop else 1,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": self.stage},
            **precision_config(dtype),
            **self.extra_config,
        })
        wrapped = self.loop_wrapped(engine, self.stage) if loop else DeepSpeedWrapped(engine, ds_optimizer, self.stage)
        wrapped.group = ctx.group
        return wrapped


def clipped(scenario) -> bool:
    """Whether the scenario clips gradients (DeepSpeed's `gradient_clipping`, from the features)."""
    return any(name == "clip" and value is not None for name, value in (scenario.features or ()))


# fp16's dynamic loss scaler, from DeepSpeed's documented config keys. The initial scale is 2**7
# instead of 2**16 and the hysteresis 1 instead of 2 so that the suite's fp16 losses (hundreds)
# overflow at the first step and train from the second: a skipped step, then real ones, within a
# two-step scenario. The oracle replays the same scaler (conformance.oracle.declared.loss_scaler).
FP16_SCALER = DynamicLossScale(init_scale=2.0**7, hysteresis=1, scale_window=1000, min_scale=1.0)


def precision_config(dtype: str) -> dict:
    """DeepSpeed's config for the parameters' dtype: `bf16`, or `fp16` with its dynamic loss scaler."""
    fp16 = {"enabled": dtype == "float16"}
    if dtype == "float16":
        fp16.update(loss_scale=0, initial_scale_power=7, hysteresis=FP16_SCALER.hysteresis,
                    loss_scale_window=FP16_SCALER.scale_window, min_loss_scale=FP16_SCALER.min_scale)
    return {"bf16": {"enabled": dtype == "bfloat16"}, "fp16": fp16}


# Models whose backward is not linear in the loss: a scale put on the loss before backward does not
# reach every gradient (why, per model).
FIXED_GRADIENT_TERMS = {
    "moe": "the MoE's aux loss gets a fixed gradient in backward (models/moe.py AuxLossScaler, Megatron's "
           "auto-scaler: an engine that scales the loss sets its scale), so it is not divided with the loss",
}


def engine_loop_limits(scenario) -> str | None:
    """What the oracle cannot judge bitwise in DeepSpeed's own loop (a reason to skip), or None."""
    switches = scenario.kwargs()
    if switches.get("discard_no_sync") or switches.get("no_sync_split"):
        return ("DeepSpeed's own loop has no no_sync(): every engine.backward is a micro-step its counter carries to "
                "the boundary, so a backward cannot be thrown away or split across no_sync() (ZeRO-2/3 refuse no_sync: "
                "'incompatible with gradient partitioning')")
    mb = driven_micro_batches(scenario)
    if mb & (mb - 1):
        return (f"{mb} micro-batches: DeepSpeed divides the loss by gradient_accumulation_steps before backward, "
                "the oracle divides each gradient; the same bits only for powers of two")
    why = FIXED_GRADIENT_TERMS.get(scenario.model)
    if why and (mb > 1 or scenario.dtype == "float16"):
        return ("DeepSpeed scales the loss before backward (divided by gradient_accumulation_steps, times fp16's loss "
                f"scale), the oracle scales each gradient: the same only where backward is linear in the loss; {why}")
    if scenario.zero_grad == "alternate":
        return "engine.step() clears the gradients itself: zero_grad(set_to_none=False) has no engine equivalent"
    return None


def initialize(module: nn.Module, ctx, optimizer: OptimizerSpec, config: dict):
    """`deepspeed.initialize` on this rank's group with the suite's fixed settings plus `config`.

    Every DeepSpeed adapter builds its engine the same way: the rank's environment, no JIT-built
    ops, one sample per micro-batch, the scenario's clipping, quiet logs. Returns (engine, optimizer).
    """
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(ctx.rank))
    os.environ.setdefault("RANK", str(ctx.rank))
    os.environ.setdefault("WORLD_SIZE", str(ctx.world_size))
    _no_jit_shm_op()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": float(optimizer.clip or 0.0),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        **config,
    }
    torch_optimizer = optimizer.build([p for p in module.parameters() if p.requires_grad])
    with contextlib.redirect_stdout(open(os.devnull, "w")):  # noqa: SIM115 - its banner and config dump
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=torch_optimizer, config=config, dist_init_required=False,
        )
    return engine, ds_optimizer


def deepspeed_zero1() -> DeepSpeedAdapter:
    return DeepSpeedAdapter(1)


def deepspeed_zero2() -> DeepSpeedAdapter:
    return DeepSpeedAdapter(2)


def deepspeed_zero3() -> DeepSpeedAdapter:
    return DeepSpeedAdapter(3)
