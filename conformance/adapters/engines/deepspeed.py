"""`deepspeed-zero1`, `deepspeed-zero2`, `deepspeed-zero3`: DeepSpeed's engine with ZeRO stage 1/2/3.

The engine owns the optimizer (protocol v2): `deepspeed.initialize` wraps the scenario's torch
optimizer in its ZeRO optimizer. Everything else is the user's plain loop — `loss.backward()`,
`optimizer.zero_grad()`, `optimizer.step()` — which DeepSpeed supports for ZeRO 1-3 (only stage 0
refuses a plain backward). Gradients are read with `deepspeed.utils.safe_get_full_grad` (a
collective for the partitioned stages) before the step, parameters with
`safe_get_full_fp32_param`.

Configuration that would otherwise change what is computed, made explicit:
- `gradient_clipping: 0.0` (DeepSpeed's default is 1.0, which clips; the oracle does not);
- fp32 throughout, `gradient_accumulation_steps: 1`, `zero_allow_untested_optimizer` (torch SGD);
- `LOCAL_RANK` is set from the rank (DeepSpeed requires it);
- the shared-memory all-reduce op DeepSpeed JIT-compiles on CPU in every new process (minutes;
  it only serves inference all-reduce) is kept off: nothing is compiled at run time.

Declared: none (every difference from torch DDP is a finding, see the xfail list).
"""

from __future__ import annotations

import contextlib
import os

from torch import Tensor, nn

from conformance.adapters.engines import probe, production_features
from conformance.adapters.protocol import OptimizerSpec
from conformance.spec import Capability as C

INSTALL = "DS_BUILD_OPS=0 pip install -c constraints.txt 'gradparity[deepspeed]'"
# The engine's documentation, for the production-training features it does its own way.
UNSUPPORTED = {
    "grad_scaler": "DeepSpeed scales the loss itself (config 'fp16': loss_scale / dynamic loss scaling); "
                   "torch's GradScaler is not applied to its optimizer",
    "freeze": "DeepSpeed's ZeRO optimizer flattens the trainable parameters at deepspeed.initialize; "
              "requires_grad changes afterwards are not supported",
}


def _cpu(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)


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
            return {n: _cpu(p.grad) for n, p in self._named() if p.requires_grad}
        return {n: _cpu(safe_get_full_grad(p)) for n, p in self._named() if p.requires_grad}

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


class DeepSpeedAdapter:
    area = "ddp"
    owns = frozenset({"optimizer"})
    checkpoint_api = True  # engine.save_checkpoint / load_checkpoint (Wrapped.checkpoint_state)

    def __init__(self, stage: int):
        self.stage = stage
        self.name = f"deepspeed-zero{stage}"
        self.version, self._why = probe("deepspeed", "deepspeed", INSTALL)
        caps = {C.FIND_UNUSED, C.BUFFER_BROADCAST, C.ENGINE_ZERO_GRAD}
        if stage == 1:
            caps.add(C.NO_SYNC)  # DeepSpeed: no_sync "incompatible with ZeRO stage 2/3"
        self.capabilities = frozenset(caps)

    def unavailable(self, scenario) -> str | None:
        if self._why:
            return self._why
        if scenario.optimizer == "none":
            return "DeepSpeed's engine needs an optimizer"
        if scenario.dtype in ("float16", "bfloat16"):
            return ("half-precision parameters: ZeRO's bf16/fp16 config exposes fp32 master-partition gradients "
                    "(safe_get_full_grad) and fp16 adds its loss scaler; not modelled by the oracle yet "
                    "(deepspeed-zero0 runs bf16)")
        return production_features(scenario, UNSUPPORTED)

    def wrap(self, module: nn.Module, ctx, options, optimizer: OptimizerSpec | None = None) -> DeepSpeedWrapped:
        engine, ds_optimizer = initialize(module, ctx, optimizer, {
            "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": self.stage},
        })
        wrapped = DeepSpeedWrapped(engine, ds_optimizer, self.stage)
        wrapped.group = ctx.group
        return wrapped


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
