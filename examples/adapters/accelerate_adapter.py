"""gradparity adapter for Hugging Face Accelerate (`Accelerator.prepare` -> torch DDP + AcceleratedOptimizer).

Written as a newcomer would, from conformance/adapters/protocol.py only (issue #24's measurement):

    PYTHONPATH=examples/adapters gradparity run --adapter accelerate_adapter:factory --profile quick

The Accelerator owns the optimizer (`prepare` wraps it) and backward (`accelerator.backward(loss)`,
which divides the loss by gradient_accumulation_steps: 1 here); `no_sync` is `accelerator.no_sync(model)`;
clipping is `accelerator.clip_grad_norm_` (first quick-profile run: clip-grad-norm failed until it was added,
because an engine owning the optimizer must clip itself).
"""

from __future__ import annotations

import os

from conformance.adapters.ddp_like import DDPLikeWrapped
from conformance.spec import Capability as C


class AccelerateWrapped(DDPLikeWrapped):
    def __init__(self, accelerator, ddp, optimizer):
        super().__init__(ddp)
        self.accelerator, self.optimizer = accelerator, optimizer

    def no_sync(self):
        return self.accelerator.no_sync(self.ddp)

    def backward(self, loss):
        self.accelerator.backward(loss)

    def clip_grad_norm_(self, max_norm):
        # An engine that owns the optimizer clips its own way (protocol.py): Accelerate's is this.
        self.accelerator.clip_grad_norm_(self.ddp.parameters(), max_norm)

    def backward_stats(self):
        return None


class AccelerateAdapter:
    name, area = "accelerate-ddp", "ddp"
    owns = frozenset({"optimizer", "backward"})
    capabilities = frozenset({C.NO_SYNC, C.BUFFER_BROADCAST})

    def __init__(self):
        import accelerate

        self.version = accelerate.__version__

    def unavailable(self, scenario):
        if scenario.optimizer == "none":
            return "Accelerator.prepare steps an optimizer"
        return None

    def wrap(self, module, ctx, options, optimizer=None):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        os.environ.update(RANK=str(ctx.rank), LOCAL_RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size),
                          LOCAL_WORLD_SIZE=str(ctx.world_size))
        AcceleratorState._reset_state(reset_partial_state=True)  # a warm rank runs many cases
        accelerator = Accelerator(cpu=True)
        model, opt = accelerator.prepare(module, optimizer.build([p for p in module.parameters() if p.requires_grad]))
        return AccelerateWrapped(accelerator, model, opt)


def factory():
    return AccelerateAdapter()
