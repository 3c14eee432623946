"""Adapters of the `data_parallel` area: single-process data parallelism.

The protocol is one call, `torch.nn.parallel.data_parallel`'s signature::

    class DataParallelAdapter(Protocol):
        name: str
        version: str
        area = "data_parallel"
        capabilities: frozenset[Capability]
        def data_parallel(self, module, inputs: tuple, devices: list, output_device, dim: int,
                          module_kwargs: dict | None = None): ...
        def unavailable(self, scenario) -> str | None: ...   # optional: skip with this reason
        def chunk_sizes(self, rows: int, replicas: int) -> list[int]: ...  # optional: its split

`chunk_sizes` declares how the implementation splits `rows` over `replicas` (the oracle replays
each replica on its own chunk, `conformance.oracle.replica_oracle`); without it the oracle accepts
either standard rule (`torch.tensor_split`'s balanced sizes or `torch.chunk`'s).

`inputs` is the tuple of positional arguments; after the call and a backward through the
returned output, the *original* module's `.grad`s must hold the full batch's gradients.
`module_kwargs` (torch's keyword of the same name) is passed only for models that take keyword
arguments (issue 30); an adapter without the parameter fails those scenarios with a TypeError.
Known-bad implementations live in the zoo: `conformance.mutants.data_parallel`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from conformance.oracle.replica_oracle import balanced_sizes, chunk_sizes
from conformance.spec import Capability, Scenario


class DataParallelAdapter(Protocol):
    name: str
    version: str
    area: str
    capabilities: frozenset[Capability]

    def data_parallel(self, module: nn.Module, inputs: tuple, devices: list, output_device: Any, dim: int,
                      module_kwargs: dict | None = None) -> Any: ...


def devices_for(scenario: Scenario, distinct: bool = False) -> list:
    """`world_size` replica devices: `["cpu"] * n` on CPU, GPUs (repeated if allowed) on CUDA."""
    n = scenario.world_size
    if scenario.device == "cpu":
        return ["cpu"] * n
    count = torch.cuda.device_count()
    if distinct:
        return list(range(n))
    return [torch.device("cuda", i % max(count, 1)) for i in range(n)]


class RefimplDataParallel:
    name = "refimpl-data-parallel"
    area = "data_parallel"
    capabilities = frozenset({Capability.HALF_PRECISION, Capability.CUDA})

    def __init__(self):
        import refimpl

        self.version = getattr(refimpl, "__version__", "0")

    def data_parallel(self, module, inputs, devices, output_device, dim, module_kwargs=None):
        from refimpl.data_parallel import data_parallel

        return data_parallel(module, inputs, devices=devices, output_device=output_device, dim=dim,
                             module_kwargs=module_kwargs)

    def devices(self, scenario: Scenario) -> list:
        return devices_for(scenario)

    def chunk_sizes(self, rows: int, replicas: int) -> tuple[int, ...]:
        """refimpl's scatter: `torch.tensor_split`'s balanced sizes, never an empty chunk."""
        return balanced_sizes(rows, replicas)


class TorchDataParallel:
    """`torch.nn.parallel.data_parallel` (what `torch.nn.DataParallel` runs): CUDA only."""

    name = "torch-data-parallel"
    area = "data_parallel"
    capabilities = frozenset({Capability.HALF_PRECISION, Capability.CUDA})
    version = torch.__version__

    def unavailable(self, scenario: Scenario) -> str | None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or scenario.device != "cuda":
            if count == 0:
                return "torch.nn.DataParallel needs CUDA devices (torch.cuda.device_count() == 0)"
            return "torch.nn.DataParallel needs CUDA devices (run with --device cuda)"
        if count < scenario.world_size:
            return f"torch.nn.DataParallel needs one GPU per replica: {scenario.world_size} replicas, {count} GPUs"
        return None

    def data_parallel(self, module, inputs, devices, output_device, dim, module_kwargs=None):
        return torch.nn.parallel.data_parallel(module, inputs, device_ids=devices, output_device=output_device, dim=dim,
                                               module_kwargs=module_kwargs)

    def devices(self, scenario: Scenario) -> list:
        return devices_for(scenario, distinct=True)

    def chunk_sizes(self, rows: int, replicas: int) -> tuple[int, ...]:
        """torch's scatter (`comm.scatter` without chunk sizes): `torch.chunk`'s ceil-sized chunks."""
        return chunk_sizes(rows, replicas)


def refimpl_data_parallel() -> RefimplDataParallel:
    return RefimplDataParallel()


def torch_data_parallel() -> TorchDataParallel:
    return TorchDataParallel()
