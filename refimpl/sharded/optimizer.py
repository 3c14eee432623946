"""ShardedOptimizer: steps this rank's shards, then all-gathers the full parameters.

Built by ``ShardedDataParallel.make_optimizer``: any ``torch.optim`` optimizer (or a factory
with the same signature) over ``sharded_parameters()``, so the optimizer state takes 1/W of
the memory; ``step()`` then all-gathers every rank's chunks so all ranks hold the updated
full parameters before the next forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

__all__ = ["ShardedModel", "ShardedOptimizer"]


class ShardedModel(Protocol):
    """What the optimizer needs of a sharded engine (``ShardedDataParallel`` is one).

    A protocol, not an import of the engine: the engine builds this optimizer, so importing
    it here would make the two modules import each other.
    """

    module: nn.Module

    def sharded_parameters(self) -> list[nn.Parameter]: ...

    def gather_parameters(self) -> None: ...

    def _assert_idle(self, what: str) -> None: ...


class ShardedOptimizer:
    """Wrap ``optimizer_class`` over this rank's shard; ``step()`` then all-gathers parameters.

    Only the chunks owned by this rank are stepped, so optimizer state (Adam's moments …)
    takes 1/W of the memory. ``state_dict()`` is this rank's shard of the state.
    """

    def __init__(self, model: ShardedModel,
                 optimizer_class: Callable[..., torch.optim.Optimizer], **kwargs) -> None:
        self.model = model
        self.optimizer = optimizer_class(model.sharded_parameters(), **kwargs)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        self.model._assert_idle("optimizer.step()")
        loss = self.optimizer.step(closure)
        self.model.gather_parameters()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the sharded gradients and any local ``no_sync()`` accumulation."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.model.module.parameters():
            p.grad = None
        clear = getattr(self.model, "clear_local_gradients", None)  # ZeRO-3: sums kept in reduce_dtype
        if clear is not None:
            clear()

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)
