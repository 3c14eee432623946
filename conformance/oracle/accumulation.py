"""Micro-batch accumulation that meets the cross-rank reduction per micro-batch (declared
`MidAccumulation.REDUCED`), for the oracle (`conformance.oracle.baseline`).

torch DDP accumulates each rank's micro-batches locally and reduces once at the boundary;
DeepSpeed ZeRO-2/3 reduce every micro-batch into their gradient partitions and add the reduced
gradients there. The two orders round differently (1 ulp in fp32 at 2 ranks), so the oracle
models the declared one instead of widening its rule.
"""

from __future__ import annotations

from conformance.oracle.baseline_events import Grads
from conformance.oracle.envelope import Envelope, reduce, staged_reduce
from conformance.spec import EXACT, Tolerance


def add_grad(a, b):
    """One more gradient added to a running sum, as autograd accumulates (`grad + new`); None is
    "no gradient yet" on either side."""
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def reduced_per_micro_batch(micro_shares: list[list[Grads]], world_size: int, rule: Tolerance = EXACT) -> dict:
    """Declared `MidAccumulation.REDUCED`: every micro-batch averaged across ranks, then the averages
    added in micro-batch order (DeepSpeed ZeRO-2/3's partitions, `accumulated_grad.add_(new)`).

    Where a micro-batch's average is order-free (1-2 ranks, exact data) this is that one value,
    bitwise. Where it is an envelope (3+ ranks, a low-precision sum), the boundary's gradient is
    judged as a sum of all W·M shares under the same rule: the summation trees, or the derived
    bound, cover every order, this one included.
    """
    out = {}
    for name in micro_shares[0][0]:
        per_micro = [reduce([shares[r][name] for r in range(world_size)], world_size, rule) for shares in micro_shares]
        if any(isinstance(v, Envelope) for v in per_micro):
            out[name] = reduce([shares[r][name] for shares in micro_shares for r in range(world_size)], world_size, rule)
            continue
        total = None
        for value in per_micro:
            total = add_grad(total, value)
        out[name] = total
    return out


def reduce_scattered_per_micro_batch(micro_shares: list[list[Grads]], world_size: int, replicas: int,
                                     rule: Tolerance = EXACT) -> dict:
    """HSDP's reduce-scatter-only accumulation (`WrapOptions.accumulate_reduce_scattered`, FSDP2
    `set_requires_all_reduce(False)`): each micro-batch summed inside its shard group, the sums
    accumulated per replica, the replicas' sums all-reduced at the synced backward. The tree and
    its rule: `conformance.oracle.envelope.staged_reduce` ([Note: the HSDP accumulation tree])."""
    return {name: staged_reduce([[shares[r].get(name) for shares in micro_shares] for r in range(world_size)],
                                replicas, rule) for name in micro_shares[0][0]}
