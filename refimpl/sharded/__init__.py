"""Sharded data parallel (ZeRO-2) and the reduce-scatter bucketer it communicates through.

* ``bucketer`` — ``ReduceScatterBucketer``: batches many small reduce-scatters into one per
  (dtype, group), FairScale's ``ReduceScatterBucketer`` contract.
* ``engine``   — ``ShardedDataParallel`` (full parameters, sharded gradients) and
  ``ShardedOptimizer`` (steps this rank's shards, all-gathers the parameters back).
"""

from .bucketer import ReduceScatterBucketer
from .engine import ShardedDataParallel, ShardedOptimizer

__all__ = ["ReduceScatterBucketer", "ShardedDataParallel", "ShardedOptimizer"]
