"""The adapter protocols: the seam between the suite and any data-parallel implementation.

An adapter object lives in each rank process (it is re-created there from its spec string,
so nothing unpicklable crosses processes). The DDP and sharded areas share `Adapter`/`Wrapped`;
other areas (data_parallel, bucketer, dist_autograd) declare small protocols of their own
next to their runners.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from conformance.spec import Capability, WrapOptions


@runtime_checkable
class Wrapped(Protocol):
    """A module wrapped for data-parallel training, as the scenarios drive it."""

    module: nn.Module  # the user's module: parameter names come from it

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any: ...

    def no_sync(self) -> AbstractContextManager: ...

    def full_gradients(self) -> dict[str, Tensor | None]:
        """Unsharded gradients by parameter name (a collective for sharded implementations)."""
        ...

    def full_parameters(self) -> dict[str, Tensor]: ...

    def full_buffers(self) -> dict[str, Tensor]: ...

    def optimizer_parameters(self) -> Iterable[nn.Parameter]:
        """What the optimizer steps (the sharded parameters for a sharded implementation)."""
        ...


@runtime_checkable
class Adapter(Protocol):
    name: str
    version: str
    area: str  # which area's scenarios it runs: "ddp", "sharded", "data_parallel", ...
    capabilities: frozenset[Capability]

    def wrap(self, module: nn.Module, ctx: Any, options: WrapOptions) -> Wrapped: ...


def missing_capabilities(adapter: Adapter, required: Iterable[Capability]) -> list[Capability]:
    return sorted((c for c in required if c not in adapter.capabilities), key=lambda c: c.value)
