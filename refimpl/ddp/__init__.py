"""DistributedDataParallel: a bucketing gradient reducer, one module per step of its algorithm.

Read in this order (the same steps as PyTorch's C++ ``Reducer``):

* ``naive``      — the algorithm without buckets: all-reduce every gradient after backward,
  divide by the world size. A teaching file and the tests' baseline.
* ``plan``       — which parameters share a bucket (pure: sizes in, index lists out).
* ``buckets``    — one bucket's flat buffer and views, and its async all-reduce.
* ``reducer``    — mark a gradient ready -> when its bucket is full, launch the bucket's
  all-reduce -> at the end of backward, finalize: wait, copy back, scale.
* ``comm_hooks`` — what "all-reduce" means for a bucket (the default, fp16/bf16 compression).
* ``sparse``     — sparse gradients: all-gather and sum instead of an all-reduce.
* ``unused_params``, ``join``, ``mixed_precision``, ``stats`` — the production features
  around it (unused parameters, uneven inputs, reduced-precision communication, timings).
* ``wrapper``    — the ``nn.Module`` users construct: construction sync, forward bookkeeping,
  ``no_sync``, state_dict, pickling.
"""

from .wrapper import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
