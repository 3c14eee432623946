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

# The engine's documentation, for the production-training features it does its own way.
UNSUPPORTED = {
    "join": "ZeroRedundancyOptimizer is a Joinable of its own: uneven inputs need "
            "torch.distributed.algorithms.Join([ddp, zero]) (its docs), not the wrapper's join() the loop uses",
}


class TorchZeroAdapter(DDPLikeAdapter):
    owns = frozenset({"optimizer"})
    checkpoint_api = True  # consolidate_state_dict (wrapped.checkpoint_state)

    def __init__(self):
        from torch.nn.parallel import DistributedDataParallel

        super().__init__("torch-zero", DistributedDataParallel, version=torch.__version__)

    def unavailable(self, scenario) -> str | None:
        if scenario.options.reduce_dtype and scenario.device == "cpu":  # torch-ddp lists it as a strict xfail
            return "torch DDP's mixed_precision needs CUDA events (on CPU/gloo its forward raises)"
        return production_features(scenario, UNSUPPORTED) or super().unavailable(scenario)

    def wrap(self, module, ctx, options, optimizer: OptimizerSpec | None = None) -> DDPLikeWrapped:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        wrapped = ZeroWrapped(super().wrap(module, ctx, options).ddp)
        params = list(wrapped.optimizer_parameters())
        wrapped.optimizer = None
        if optimizer is not None and optimizer.torch_class is not None and params:
            wrapped.optimizer = ZeroRedundancyOptimizer(
                params, optimizer_class=optimizer.torch_class, process_group=ctx.group, **optimizer.hyperparameters,
            )
        wrapped.group = ctx.group
        return wrapped


class ZeroWrapped(DDPLikeWrapped):
    """torch DDP + ZeroRedundancyOptimizer: the gradients are DDP's full averages on every rank."""

    def clip_grad_norm_(self, max_norm: float) -> None:
        # Every rank holds every averaged gradient (DDP all-reduces them): torch's clip is global.
        torch.nn.utils.clip_grad_norm_(list(self.optimizer_parameters()), max_norm)

    def checkpoint_state(self) -> dict:
        """DDP's state_dict and the optimizer's full state (`consolidate_state_dict` to every rank in turn)."""
        import torch.distributed as dist

        me, state = dist.get_rank(self.group), None
        for rank in range(dist.get_world_size(self.group)):  # a collective; only `to` keeps the result
            self.optimizer.consolidate_state_dict(to=dist.get_global_rank(self.group, rank))
            if rank == me:
                state = self.optimizer.state_dict()
        return {"model": self.ddp.state_dict(), "optimizer": state}

    def load_checkpoint_state(self, state: dict) -> None:
        self.ddp.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def torch_zero() -> TorchZeroAdapter:
    return TorchZeroAdapter()
