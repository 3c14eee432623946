"""refimpl: a readable, production-grade reference engine for data-parallel training.

Public names are imported lazily so that `import refimpl` stays cheap and each part
(DDP, data_parallel, the reduce-scatter bucketer, sharded data parallel, distributed
autograd) only pulls in what it needs.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

_EXPORTS = {
    "DistributedDataParallel": "refimpl.ddp",
    "DataParallel": "refimpl.data_parallel",
    "ReduceScatterBucketer": "refimpl.sharded",
    "ShardedDataParallel": "refimpl.sharded",
}

_SUBPACKAGES = ("data_parallel", "ddp", "distributed_autograd", "sharded")

__all__ = sorted(_EXPORTS) + list(_SUBPACKAGES)


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"refimpl.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'refimpl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
