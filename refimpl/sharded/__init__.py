"""Sharded data parallel (ZeRO-2) and the reduce-scatter bucketer it communicates through.

* ``bucketer`` — ``ReduceScatterBucketer``: batches many small reduce-scatters into one per
  (dtype, group), FairScale's ``ReduceScatterBucketer`` contract.
* ``engine``   — ``ShardedDataParallel``: full parameters, gradients reduce-scattered into
  this rank's shards as backward ends.
* ``optimizer`` — ``ShardedOptimizer``: steps this rank's shards, all-gathers the parameters.
* ``zero3``    — ``FullyShardedDataParallel`` (ZeRO-3): parameters sharded too, all-gathered
  per unit for its forward and backward, a ``MixedPrecisionPolicy`` (``precision``), full and
  sharded state dicts, HSDP: sharded within a group, replicated across groups (``hsdp``).
* ``checkpoint`` — state dicts of both engines (and their optimizers) that
  ``torch.distributed.checkpoint`` saves and loads: shards as DTensors, or full tensors.
"""

from .bucketer import ReduceScatterBucketer
from .engine import ShardedDataParallel
from .optimizer import ShardedOptimizer
from .zero3 import FullyShardedDataParallel, MixedPrecisionPolicy

__all__ = ["FullyShardedDataParallel", "MixedPrecisionPolicy", "ReduceScatterBucketer", "ShardedDataParallel",
           "ShardedOptimizer"]
