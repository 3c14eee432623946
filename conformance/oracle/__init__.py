"""The oracle: every single-process replay and every rule the judge compares with, in one place.

A correct data-parallel run is defined here, not by another engine: the oracle replays every
rank in one process, from the same seeds, with the kernels the ranks use, and says what each
rank must show (docs/oracle.md has a chapter per part):

- `baseline`             the replay of the ranks: construction, local gradients, the synced
                         average, the step (DESIGN.md, "The contract"); `compute` is the ddp
                         and sharded areas' oracle;
- `baseline_features`    the same replay with production features (join, AMP, compile,
                         clipping, checkpoint round trips; `conformance.features`);
- `baseline_events`      what the replays fill: `Expected` comparison points, a `Baseline`;
- `baseline_mixed`       a sharded engine's mixed-precision policy (param and reduce dtypes);
- `buffers`              which buffers each rank forwards from (rank 0's broadcast, skipped after
                         a no_sync() forward; each rank's own with broadcast_buffers=False);
- `replica_oracle`       data_parallel replica by replica, on the implementation's own split;
- `envelope`             what a cross-rank sum may be, per element: the summation-order envelope
                         and the derived bounds;
- `anchor`               the engine's own state at every step boundary (re-anchored steps);
- `accumulation`         micro-batch accumulation trees that meet the reduction per micro-batch;
- `allreduce_order`      a backend's all-reduce order, discovered by probing, replayed bitwise;
- `clip_bound`           the derived bound of a step clipped by a global norm;
- `declared/`            engine rules an adapter declares, modelled exactly: PowerSGD
                         (`powersgd_oracle`), DeepSpeed's clipping (`deepspeed_clip`), dynamic
                         loss scalers (`loss_scaler`);
- `<area>.py`            the other areas' oracles: `bucketer` (the exact reduce-scatter sums),
                         `data_parallel` (the full-batch or per-chunk forward), `dist_autograd`
                         (local autograd over the same composition).

Every area's `Area.oracle` (`conformance.area`) points into this package. Nothing here runs a
process group or judges: the judge (`conformance.judge`) compares the ranks' records with what
these modules compute.
"""

from conformance.oracle.baseline import average, compute, compute_anchored, oracles
from conformance.oracle.baseline_events import Baseline, Expected
from conformance.oracle.envelope import Envelope, reduce, rule_of

__all__ = ["Baseline", "Envelope", "Expected", "average", "compute", "compute_anchored", "oracles", "reduce",
           "rule_of"]
