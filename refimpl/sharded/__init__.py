"""Sharded data parallel (ZeRO-2) and the reduce-scatter bucketer it communicates through.

* ``bucketer`` — ``ReduceScatterBucketer``: batches many small reduce-scatters into one per
  (dtype, group), FairScale's ``ReduceScatterBucketer`` contract.
* ``engine``   — ``ShardedDataParallel``: full parameters, gradients reduce-scattered into
  this rank's shards as backward ends.
* ``optimizer`` — ``ShardedOptimizer``: steps this rank's shards, all-gathers the parameters.
"""

from .bucketer import ReduceScatterBucketer
from .engine import ShardedDataParallel
from .optimizer import ShardedOptimizer

__all__ = ["ReduceScatterBucketer", "ShardedDataParallel", "ShardedOptimizer"]
