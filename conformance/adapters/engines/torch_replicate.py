"""`torch-replicate`: `torch.distributed._composable.replicate` (composable DDP).

`replicate(module, **ddp_kwargs)` builds a torch DDP lazily, in a forward pre-hook: rank 0's
state reaches the other ranks at the first forward, not at the call — declared as
`construction_sync: first-forward` (torch/distributed/_composable/replicate.py: `lazy_init` runs
from `forward_pre_hook`). `no_sync` is `module.set_requires_gradient_sync(False)`.
"""

from __future__ import annotations

import contextlib

import torch

from conformance.adapters.ddp_like import DDP_CAPABILITIES, DDPLikeWrapped
from conformance.adapters.engines import production_features
from conformance.semantics import ConstructionSync, Semantics
from conformance.spec import Capability as C

SEMANTICS = Semantics(
    construction_sync=ConstructionSync.FIRST_FORWARD,
    sources=("torch/distributed/_composable/replicate.py: DDP is built by _ReplicateState.lazy_init, "
             "called from forward_pre_hook",),
)


# The engine's documentation, for the production-training features it does its own way.
UNSUPPORTED = {
    "save_load_at": "replicate() is composable: the module keeps its own state_dict keys (no 'module.' prefix "
                    "as torch DDP's wrapper), so the round trip is the plain module's",
}


class ReplicateWrapped(DDPLikeWrapped):
    def __init__(self, module):
        self.ddp = self.module = module

    @contextlib.contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def backward_stats(self):
        return None


class ReplicateAdapter:
    name, area = "torch-replicate", "ddp"
    capabilities = DDP_CAPABILITIES - {C.COMM_HOOK, C.GRAD_AS_BUCKET_VIEW, C.STATIC_GRAPH, C.JOIN, C.MIXED_PRECISION}
    semantics = SEMANTICS

    def __init__(self):
        self.version = torch.__version__

    def unavailable(self, scenario) -> str | None:
        return production_features(scenario, UNSUPPORTED)

    def wrap(self, module, ctx, options, optimizer=None) -> ReplicateWrapped:
        from refimpl._torch_compat import composable_replicate

        replicate = composable_replicate()

        kwargs = dict(process_group=ctx.group, find_unused_parameters=options.find_unused_parameters)
        if not options.broadcast_buffers:
            kwargs["broadcast_buffers"] = False
        if options.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = options.bucket_cap_mb
        if ctx.device.type == "cuda":
            kwargs["device_ids"] = [ctx.device.index]
        return ReplicateWrapped(replicate(module, **kwargs))


def torch_replicate() -> ReplicateAdapter:
    return ReplicateAdapter()
