"""gradparity adapter for Lightning Fabric's DDP strategy (`Fabric(strategy="ddp", accelerator="cpu")`).

Written as a newcomer would, from the README, docs/ and conformance/adapters/protocol.py (issue #24's
measurement, docs/engines.md):

    PYTHONPATH=examples/adapters gradparity run --adapter lightning_fabric_adapter:factory --profile quick

Fabric is driven the way its docs train: `fabric.setup(model, optimizer)` wraps the model in torch DDP
(strategy kwargs go to DDP's constructor, so the suite's group and options pass through) and the
optimizer in a `_FabricOptimizer`; backward is `fabric.backward(loss)`, `no_sync` is
`fabric.no_backward_sync(model)`, clipping is `fabric.clip_gradients`. Each rank process is one
"externally launched" Fabric process (LOCAL_RANK set, as under torchrun).
"""

from __future__ import annotations

import os

import torch

from conformance.adapters.ddp_like import DDPLikeWrapped
from conformance.spec import Capability as C


class FabricWrapped(DDPLikeWrapped):
    def __init__(self, fabric, model, optimizer):
        super().__init__(model._forward_module)  # the torch DDP (Fabric's .module is the user's model)
        self.fabric, self.model, self.optimizer = fabric, model, optimizer

    def __call__(self, *inputs, **kwargs):
        return self.model(*inputs, **kwargs)  # through _FabricModule, as a Fabric user calls it

    def no_sync(self):
        return self.fabric.no_backward_sync(self.model)

    def backward(self, loss):
        self.fabric.backward(loss)

    def clip_grad_norm_(self, max_norm):
        self.fabric.clip_gradients(self.model, self.optimizer, max_norm=max_norm)

    def checkpoint_state(self):  # what fabric.save(path, {"model": m, "optimizer": o}) writes
        strategy = self.fabric.strategy
        return {"model": strategy.get_module_state_dict(self.model),
                "optimizer": strategy.get_optimizer_state(self.optimizer)}

    def load_checkpoint_state(self, state):  # what fabric.load(path, {...}) does with it
        self.fabric.strategy.load_module_state_dict(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class FabricAdapter:
    name, area = "lightning-fabric-ddp", "ddp"
    owns = frozenset({"optimizer", "backward"})  # owns_for drops "optimizer" for optimizer-less scenarios
    checkpoint_api = True  # Wrapped.checkpoint_state / load_checkpoint_state
    capabilities = frozenset({C.NO_SYNC, C.BUFFER_BROADCAST, C.FIND_UNUSED, C.BUCKET_CAP,
                              C.GRAD_AS_BUCKET_VIEW, C.STATIC_GRAPH, C.HALF_PRECISION, C.SPARSE})

    def __init__(self):
        import lightning

        self.version = lightning.__version__

    def owns_for(self, scenario):  # fabric.setup(model) alone when the scenario has no optimizer
        return {"backward"} | ({"optimizer"} if scenario.optimizer != "none" else set())

    def wrap(self, module, ctx, options, optimizer=None):
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import DDPStrategy

        os.environ.update(LOCAL_RANK=str(ctx.rank), NODE_RANK="0")  # "launched externally", like torchrun
        ddp_kwargs = dict(process_group=ctx.group, find_unused_parameters=options.find_unused_parameters,
                          gradient_as_bucket_view=options.gradient_as_bucket_view,
                          static_graph=options.static_graph, broadcast_buffers=options.broadcast_buffers)
        if options.bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = options.bucket_cap_mb
        dtype = next(module.parameters()).dtype  # half-precision models train with Fabric's "true" plugins
        precision = {torch.bfloat16: "bf16-true", torch.float16: "16-true"}.get(dtype, "32-true")
        fabric = Fabric(accelerator="cpu", devices=ctx.world_size, precision=precision,
                        strategy=DDPStrategy(**ddp_kwargs))
        fabric.launch()
        if optimizer is None:
            return FabricWrapped(fabric, fabric.setup(module), None)
        model, opt = fabric.setup(module, optimizer.build([p for p in module.parameters() if p.requires_grad]))
        return FabricWrapped(fabric, model, opt)


def factory():
    return FabricAdapter()
