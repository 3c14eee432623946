"""Sharded families of issue #26 part A: the mixed-precision policy (S19) and
``reshard_after_forward`` as an int (S20).

**Mixed precision** (``WrapOptions(param_dtype=..., reduce_dtype=...)``: FSDP2's
``MixedPrecisionPolicy``, FSDP1's ``MixedPrecision``, refimpl ZeRO-3's policy). The oracle models
the casts (`conformance.oracle.baseline_mixed`): fp32 masters cast to bf16, forward and backward in bf16,
each rank's bf16 gradient cast to the reduce dtype, reduced, cast back to fp32. Continuous data,
so a missing or extra cast changes bits. The rules:

- ``reduce_dtype=fp32``: the bf16 gradients are exact in fp32, so the reduction is the fp32 one:
  bitwise at two ranks, bitwise to a summation order at four (1/W pre, post or FSDP's split);
- ``reduce_dtype=bf16``: at two ranks the bf16 sum of two shares is one rounding, order-free,
  so bitwise; at four ranks the derived bound of a sum rounded in bf16 (whether the backend
  rounds every addition to bf16 or accumulates wider and rounds once, both lie in it).

An engine that reduces in bf16 when fp32 was asked, computes in fp32 despite ``param_dtype``, or
hands the optimizer a bf16 gradient is outside those rules. The straight-through check (training
from the seeds, where a last-bit difference in a parameter can flip a bf16 rounding in the next
forward) keeps bf16's summand-scaled band.

**reshard_after_forward=k** (an int; FSDP2 reshards a unit to groups of ``k`` ranks after its
forward and all-gathers within the group before its backward): values do not change, so the
oracle is the plain one and the scenario is judged like ``nested-reshard``, shard by shard
(S12). Valid on a 1-D mesh of W ranks: a divisor of W strictly between 1 and W (FSDP2 reads 1
as False and W as True), so the family runs at w4 (k=2) and w8 (k=2, 4).
"""

from __future__ import annotations

from dataclasses import replace

from conformance.catalogue.ddp_scenario import make
from conformance.catalogue.profiles import FULL, QUICK, STANDARD
from conformance.spec import Capability as C
from conformance.spec import (
    Scenario,
    Tolerance,
    WrapOptions,
    derived_bound,
    float_tolerance,
    summation_order,
)

DIVIDE = ("pre", "post", "split")  # where sharded engines may place 1/W (conformance.oracle.envelope)


def mp_tolerance(reduce_dtype: str, w: int) -> Tolerance:
    """The rule of a bf16-compute scenario's cross-rank sum (see the module docstring)."""
    straight = float_tolerance("bfloat16", w, "bf16 compute: a last-bit change in a parameter can flip a "
                                             "bf16 rounding in the next forward (rounding compounds over steps)")
    if reduce_dtype == "float32":
        return replace(summation_order("float32", w, divide=DIVIDE,
                                       reason="bf16 gradients, exact in fp32, reduced in fp32"),
                       straight_through=straight)
    if w <= 2:
        return Tolerance(True, rule="summation-order", divide=DIVIDE, straight_through=straight,
                         reason="bf16 shares summed in bf16: one rounding at two ranks, order-free")
    return derived_bound("bfloat16", w, divide=DIVIDE, straight_through=straight,
                         reason=f"bf16 shares of {w} ranks summed in bf16 (per-addition or once: both bounded)")


def _clauses(s: Scenario, *extra: str) -> Scenario:
    from conformance.catalogue.sharded_clauses import clauses_of

    return s.with_(clauses=tuple(sorted(set(clauses_of(s)) | set(extra), key=lambda x: int(x[1:]))))


def mixed_precision_scenarios() -> list[Scenario]:
    def m(name, model, reduce, *, w=2, units=None, **kw):
        options = WrapOptions(param_dtype="bfloat16", reduce_dtype=reduce, units=units)
        need = {C.SHARD_UNITS} if units else set()
        s = make(name, model, w=w, area="sharded", options=options, exact_data=False, steps=kw.pop("steps", 2),
                 tolerance=mp_tolerance(reduce, w), extra_requires=frozenset(need), **kw)
        return _clauses(s, "S19")

    return [
        m("mp-bf16-reduce-fp32", "mlp", "float32", profiles=STANDARD,
          description="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 compute, fp32 reduce, fp32 shards"),
        m("mp-bf16-reduce-fp32", "mlp", "float32", w=4, units="children", profiles=STANDARD),
        m("mp-bf16-reduce-fp32", "transformer", "float32", units="children", optimizer="adam", profiles=STANDARD),
        m("mp-bf16-reduce-bf16", "mlp", "bfloat16", profiles=QUICK,
          description="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16): the sum rounded in bf16, cast back"),
        m("mp-bf16-reduce-bf16", "mlp", "bfloat16", w=4, profiles=STANDARD),  # root only: FSDP1 runs it too
        # Inside no_sync(): the local sum of bf16 micro-batch gradients is kept in reduce_dtype (FSDP2,
        # refimpl) or in param_dtype (FSDP1), declared (conformance.semantics.MixedAccumulation) and
        # modelled exactly; three micro-batches, so a bf16 running sum rounds twice.
        m("mp-bf16-reduce-fp32-no-sync", "mlp", "float32", micro_batches=3, profiles=QUICK,
          description="MixedPrecisionPolicy(bf16, reduce fp32) inside no_sync(): the local sum of three micro-batches "
                      "in the declared dtype, reduced in fp32"),
        m("mp-bf16-reduce-fp32-no-sync", "mlp", "float32", w=4, micro_batches=2, profiles=STANDARD),
    ]


def reshard_int_scenarios() -> list[Scenario]:
    def m(name, model, k, *, w, **kw):
        options = WrapOptions(units="children", reshard_after_forward=k)
        s = make(name, model, w=w, area="sharded", options=options,
                 extra_requires=frozenset({C.SHARD_UNITS, C.RESHARD_INT}), **kw)
        if s.tolerance.kind in ("summation-order", "derived-bound"):
            s = s.with_(tolerance=replace(s.tolerance, divide=DIVIDE))
        return _clauses(s, "S13", "S20")

    return [
        m("nested-reshard-to-2", "mlp", 2, w=4, steps=2, profiles=STANDARD,
          description="reshard_after_forward=2: each block resharded to groups of 2 ranks after forward"),
        # SGD, not Adam: at w4 the attention's key bias has a gradient that is rounding noise
        # (softmax is shift-invariant); Adam scales noise to +-lr, so the straight-through check
        # (4-rank summation orders compounding over steps) cannot hold there for any engine.
        m("nested-reshard-to-2", "transformer", 2, w=4, profiles=FULL),
        m("nested-reshard-to-4", "mlp", 4, w=8, model_kwargs={"width": 4}, profiles=FULL),
    ]


def scenarios() -> list[Scenario]:
    return mixed_precision_scenarios() + reshard_int_scenarios()
