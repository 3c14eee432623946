"""`torch-zero`: torch DDP with `torch.distributed.optim.ZeroRedundancyOptimizer` (ZeRO-1).

The optimizer is the engine's (protocol v2, owns "optimizer"): each rank steps its shard of
the optimizer state and `step()` broadcasts the updated parameters. Everything else is the
user's plain loop on torch DDP, so its semantics are torch DDP's.
"""

from __future__ import annotations

import torch

from conformance.adapters.ddp_like import DDPLikeAdapter, DDPLikeWrapped
from conformance.adapters.engines import production_features
from conformance.adapters.protocol import OptimizerSpec


class TorchZeroAdapter(DDPLikeAdapter):
    owns = frozenset({"optimizer"})

    def __init__(self):
        from torch.nn.parallel import DistributedDataParallel

        super().__init__("torch-zero", DistributedDataParallel, version=torch.__version__)

    def unavailable(self, scenario) -> str | None:
        if scenario.options.reduce_dtype and scenario.device == "cpu":  # torch-ddp lists it as a strict xfail
            return "torch DDP's mixed_precision needs CUDA events (on CPU/gloo its forward raises)"
        return production_features(scenario) or super().unavailable(scenario)

    def wrap(self, module, ctx, options, optimizer: OptimizerSpec | None = None) -> DDPLikeWrapped:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        wrapped = super().wrap(module, ctx, options)
        params = list(wrapped.optimizer_parameters())
        wrapped.optimizer = None
        if optimizer is not None and optimizer.torch_class is not None and params:
            wrapped.optimizer = ZeroRedundancyOptimizer(
                params, optimizer_class=optimizer.torch_class, process_group=ctx.group, **optimizer.hyperparameters,
            )
        return wrapped


def torch_zero() -> TorchZeroAdapter:
    return TorchZeroAdapter()
