"""`fairscale-sdp`: FairScale's `ShardedDataParallel` with its `OSS` sharded optimizer (ZeRO-2).

OSS is the engine's optimizer (protocol v2, owns "optimizer"): each rank steps the parameters
it owns and `step()` broadcasts them. SDP *reduces* each gradient to its owner rank only and
frees it elsewhere, so `full_gradients` is a collective: every owner broadcasts its gradient
(and whether it has one). Inside `no_sync()` every rank's local gradient is read as it is.

The loop is the user's plain one — `loss.backward()`, `optimizer.zero_grad()` (torch 2.x's
default `set_to_none=True`), `optimizer.step()` — which is where FairScale#354 shows; the
`zero-grad-engine` scenario uses `sdp.zero_grad()` instead, the workaround FairScale documents.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from conformance.adapters.engines import probe, production_features
from conformance.adapters.protocol import OptimizerSpec
from conformance.spec import Capability as C

INSTALL = "pip install -c constraints.txt 'gradparity[fairscale]'  (fairscale==0.4.13)"
# The engine's documentation, for the production-training features it does its own way.
UNSUPPORTED = {
    "grad_scaler": "FairScale documents fairscale.optim.grad_scaler.ShardedGradScaler for OSS + ShardedDDP "
                   "(torch's GradScaler sees only this rank's shard of the gradients)",
    "freeze": "ShardedDataParallel builds its reduce buckets at construction: FairScale's docs require "
              "sdp.refresh_trainable() after a requires_grad change",
}


def _cpu(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)


class FairScaleSDPWrapped:
    def __init__(self, sdp, optimizer, group):
        self.sdp, self.optimizer, self.group = sdp, optimizer, group
        self.module = sdp.module
        self._synced = True

    def __call__(self, *inputs, **kwargs):
        self._synced = not self.sdp._should_accumulate_grads
        return self.sdp(*inputs, **kwargs)

    def no_sync(self):
        return self.sdp.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sdp.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float) -> None:
        """OSS.clip_grad_norm: the global norm over every rank's shard (FairScale's documented way)."""
        self.optimizer.clip_grad_norm(max_norm)

    def full_gradients(self) -> dict[str, Tensor | None]:
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if not self._synced:  # inside no_sync: every rank's own local accumulation
            return {n: _cpu(p.grad) for n, p in named}
        owner = self.optimizer._param_to_rank
        out = {}
        for n, p in named:
            src = dist.get_global_rank(self.group, owner[p])
            present = torch.tensor([float(p.grad is not None)], device=p.device)  # NCCL: the rank's device
            dist.broadcast(present, src=src, group=self.group)
            if not present.item():
                out[n] = None
                continue
            g = p.grad.detach().clone() if dist.get_rank(self.group) == owner[p] else torch.empty_like(p)
            dist.broadcast(g, src=src, group=self.group)
            out[n] = _cpu(g)
        return out

    def full_parameters(self) -> dict[str, Tensor]:
        return {n: _cpu(p) for n, p in self.module.named_parameters()}

    def full_buffers(self) -> dict[str, Tensor]:
        return {n: _cpu(b) for n, b in self.module.named_buffers()}

    def optimizer_parameters(self):
        return [p for p in self.module.parameters() if p.requires_grad]


class FairScaleSDPAdapter:
    name, area = "fairscale-sdp", "ddp"
    owns = frozenset({"optimizer"})
    capabilities = frozenset({C.NO_SYNC, C.BUFFER_BROADCAST, C.ENGINE_ZERO_GRAD, C.FIND_UNUSED})

    def __init__(self):
        self.version, self._why = probe("fairscale", "fairscale", INSTALL)

    def unavailable(self, scenario) -> str | None:
        if self._why:
            return self._why
        if scenario.optimizer == "none":
            return "OSS needs an optimizer"
        return production_features(scenario, UNSUPPORTED)

    def wrap(self, module: nn.Module, ctx, options, optimizer: OptimizerSpec | None = None) -> FairScaleSDPWrapped:
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim import OSS

        params = [p for p in module.parameters() if p.requires_grad]
        oss = OSS(params, optim=optimizer.torch_class, group=ctx.group, **optimizer.hyperparameters)
        sdp = ShardedDataParallel(module, oss, process_group=ctx.group, broadcast_buffers=options.broadcast_buffers)
        return FairScaleSDPWrapped(sdp, oss, ctx.group)


def fairscale_sdp() -> FairScaleSDPAdapter:
    return FairScaleSDPAdapter()
