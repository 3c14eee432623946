"""Declared semantics: the rules where a data-parallel engine may legitimately differ from torch DDP.

torch's `DistributedDataParallel` fixes one answer to each question below; other engines answer
some of them differently *by design* (DeepSpeed gives an unused parameter a zero gradient,
composable `replicate` synchronizes at the first forward, pytorch-pfn-extras broadcasts buffers
after backward). An adapter declares its answers in a `Semantics`; the oracle
(`conformance.oracle.baseline`) models exactly what is declared and the contract checks it, so a
declaration never switches a check off — it changes what "right" means, and the report prints
every deviation from torch DDP next to the verdict with the engine documentation it rests on.

Usage::

    from conformance.semantics import Semantics, Buffers, Unused

    class MyAdapter:
        semantics = Semantics(
            buffers=Buffers.AFTER_BACKWARD,
            unused=Unused.ZEROS,
            sources=("https://my-engine.readthedocs.io/ddp.html#buffers",),
        )

An adapter whose rules depend on the scenario defines `semantics_for(scenario)` instead.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace

from conformance.spec import Tolerance, derived_bound


class Accumulation(str, enum.Enum):
    """How micro-batches accumulated under `no_sync()` combine into the synced gradient."""

    SUM = "sum"  # torch DDP: grads of all micro-batches add up
    MEAN = "mean"  # the engine divides each micro-batch's gradient by the number of micro-batches


class MidAccumulation(str, enum.Enum):
    """Where micro-batches meet the cross-rank reduction when they accumulate into one step."""

    # torch DDP: each rank accumulates its own micro-batches (inside no_sync(), judged per rank),
    # and the boundary's backward reduces the accumulated sums once.
    LOCAL = "local"
    # The engine reduces every micro-batch and accumulates the reduced gradients (DeepSpeed ZeRO-2/3
    # into their gradient partitions, releasing param.grad): no per-rank gradient exists between
    # boundaries, and the boundary's gradient is the sum over micro-batches of each one's average.
    REDUCED = "reduced-each-micro-batch"


class ConstructionSync(str, enum.Enum):
    """When rank 0's parameters reach the other ranks."""

    EAGER = "eager"  # torch DDP: inside the constructor
    FIRST_FORWARD = "first-forward"  # lazily, at the first forward (composable replicate)
    # torchft's async quorum: every rank runs step 0 from its own parameters, a replica that heals
    # does not participate (only rank 0's gradient is averaged, over the ranks that contributed), and
    # rank 0's state is loaded everywhere at the first optimizer step.
    FIRST_STEP = "first-optimizer-step"


class Buffers(str, enum.Enum):
    """Which buffers each rank holds and forwards from."""

    BEFORE_FORWARD = "rank0-before-forward"  # torch DDP: rank 0's buffers at construction and before each synced forward
    NEVER = "never"  # never synchronized: every rank keeps and updates its own
    CONSTRUCTION_ONLY = "construction-only"  # rank 0's at construction, then each rank its own
    AFTER_BACKWARD = "rank0-after-backward"  # rank 0's at construction and after each synced backward


class Precision(str, enum.Enum):
    """What the optimizer steps when the parameters are half precision."""

    PARAMS = "params"  # torch DDP: the user's optimizer steps the parameters themselves
    # fp32 master copies: the half-precision gradient, cast to fp32, steps an fp32 copy of each
    # parameter, which is then cast back (DeepSpeed's bf16 optimizer without loss scaling)
    FP32_MASTER = "fp32-master"
    # fp32 masters, and every micro-batch's half-precision gradient added into a per-rank fp32
    # accumulator that is then reduced in fp32 (DeepSpeed BF16_Optimizer: bf16 + ZeRO-1 +
    # data_types.grad_accum_dtype fp32)
    FP32_MASTER_FP32_ACCUMULATION = "fp32-master-fp32-accumulation"


class MixedAccumulation(str, enum.Enum):
    """Under a sharded mixed-precision policy (compute in ``param_dtype``, reduce in a wider
    ``reduce_dtype``): the dtype a gradient accumulated inside ``no_sync()`` is kept in until the
    synced backward reduces it (`conformance.oracle.baseline` models the declared one exactly)."""

    # FSDP2 (FSDPParam.to_accumulated_grad_if_needed / accumulate_unsharded_grad_if_needed) and
    # refimpl ZeRO-3: each micro-batch's gradient cast to reduce_dtype, the running sum kept there
    REDUCE_DTYPE = "reduce-dtype"
    # FSDP1: autograd's running sum in the flat parameter's param_dtype .grad (its post-backward
    # hook returns before the cast when not syncing), cast to reduce_dtype once at the synced backward
    PARAM_DTYPE = "param-dtype"


class Unused(str, enum.Enum):
    """What a parameter no rank used holds after a synced backward."""

    NONE = "none"  # torch DDP: grad stays None
    ZEROS = "zeros"  # a zero tensor


class Scaling(str, enum.Enum):
    """Where a synced gradient's 1/W is applied (it decides the last bit unless W is a power of two)."""

    PRE = "pre"  # torch DDP: every rank scales its share, then the shares are summed
    POST = "post"  # the shares are summed, then the sum is scaled
    # Undeclared (a `--ddp-class` class without `gradparity_semantics`): both are exact averages,
    # so either passes, and the report says which one the engine matched ([Note: which placement of 1/W]).
    EITHER = "pre-or-post"


@dataclass(frozen=True)
class Semantics:
    """One engine's answers. The defaults are torch DDP's; anything else is a declared deviation.

    `lossy` (a tolerance) declares lossy communication (PowerSGD, compression hooks): ranks must
    still be bitwise identical, and every value must be within the stated bound of the oracle.
    `sources` cite the engine documentation (or source) each deviation rests on.
    """

    accumulation: Accumulation = Accumulation.SUM
    mid_accumulation: MidAccumulation = MidAccumulation.LOCAL
    construction_sync: ConstructionSync = ConstructionSync.EAGER
    buffers: Buffers = Buffers.BEFORE_FORWARD
    unused: Unused = Unused.NONE
    scaling: Scaling = Scaling.PRE
    precision: Precision = Precision.PARAMS
    # No torch DDP counterpart (its scenarios have no param_dtype policy): FSDP2's rule is the default.
    mixed_accumulation: MixedAccumulation = MixedAccumulation.REDUCE_DTYPE
    lossy: Tolerance | None = None
    # Lossy communication the oracle simulates exactly (conformance.oracle.declared.powersgd_oracle.PowerSGDConfig):
    # no bound, the algorithm itself, run over the ranks' gradients with the engine's state and seeds.
    communication: object | None = None
    # The engine's own gradient clipping, replayed exactly (conformance.oracle.declared.deepspeed_clip.Clipping):
    # the same global L2 norm as torch's clip_grad_norm_, summed and applied in the engine's order.
    clipping: object | None = None
    # A dynamic loss scaler the engine applies inside its own backward (conformance.oracle.declared.loss_scaler):
    # replayed, overflow steps skipped; the gradients recorded are the scaled ones.
    loss_scaler: object | None = None
    sources: tuple[str, ...] = ()

    def deviations(self) -> list[str]:
        """Every declared rule that differs from torch DDP's, as `name: ours (torch DDP: theirs)`."""
        out = []
        for f in fields(self):
            if f.name in ("sources", "lossy", "communication", "clipping", "loss_scaler", "mixed_accumulation"):
                continue
            ours, theirs = getattr(self, f.name), getattr(TORCH_DDP, f.name)
            if ours == Scaling.EITHER:
                out.append("scaling: not declared, either exact placement of 1/W accepted (torch DDP: pre)")
            elif ours != theirs:
                out.append(f"{f.name}: {ours.value} (torch DDP: {theirs.value})")
        if self.mixed_accumulation != MixedAccumulation.REDUCE_DTYPE:
            out.append(f"no_sync() accumulation under a mixed-precision policy: in {self.mixed_accumulation.value} "
                       "(FSDP2: reduce-dtype)")
        if self.loss_scaler is not None:
            out.append(f"loss scaling: {self.loss_scaler.describe()}")
        if self.clipping is not None:
            out.append(f"gradient clipping: {self.clipping.describe()}")
        if self.communication is not None:
            out.append(f"lossy communication: {self.communication.describe()}, ranks bitwise")
        if self.lossy is not None:
            out.append(f"lossy communication: {self.lossy.describe()} vs the oracle, ranks bitwise ({self.lossy.reason})")
        return out

    def describe(self) -> str:
        return "; ".join(self.deviations()) or "torch DDP semantics"


TORCH_DDP = Semantics()

# One unit in the last place at 1.0 of each reduce dtype.
_ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10}
REDUCE_DTYPE_SOURCE = ("torch.nn.parallel.DistributedDataParallel(mixed_precision=_MixedPrecision(reduce_dtype=...)) "
                       "and refimpl/mixed_precision.py: gradients communicated in reduce_dtype, cast back; "
                       "within one reduce_dtype ulp per summand of a full-precision reduction, per step")


def reduce_dtype_bound(dtype: str, world_size: int) -> Tolerance:
    """The rule of gradients reduced in `dtype` (torch DDP's `mixed_precision.reduce_dtype`).

    Each rank's share is cast to `dtype` and divided there (one rounding each), then summed in
    `dtype` (W - 1 roundings): the bound derived per element from the shares
    (`conformance.oracle.envelope`). The old band (one `dtype` ulp per summand) is the straight-through
    check's (implied where a scenario runs one step: `conformance.judge.contract`).

    Composed over M micro-batches (the first M - 1 inside ``no_sync()``): a rank's share is its
    local sum s_r = g_{r,1} + ... + g_{r,M}, accumulated by autograd in the parameters' dtype,
    in the order the oracle replays bitwise (no rounding of its own to bound), and cast to
    `dtype` once, at the synced backward. The bound is therefore the same with x_r = s_r / W:

        |ŝ - Σ_r x_r| <= γ_m · Σ_r |x_r| + m·W·η,   m = 1 (the cast) + (W - 1) (the sum)
                                                        + 2 where W is not a power of two (1/W),

    γ_m = m·u/(1 - m·u) with u the unit roundoff of `dtype`, η half its smallest subnormal, and
    does not grow with M. An engine that rounds each micro-batch's local sum to `dtype`
    (torch keeps ``p.grad`` in the parameters' dtype) adds u·|g_{r,1} + ... + g_{r,j}| for each
    j < M: beyond the bound wherever a partial sum is larger than the whole (micro-batches that
    cancel), which continuous data has.
    """
    ulps = max(2, world_size)
    band = Tolerance(False, rtol=ulps * _ULP[dtype], atol=ulps * _ULP[dtype],
                     reason=f"mixed_precision reduce_dtype={dtype}: {ulps} {dtype} ulps ({world_size} summands)")
    return derived_bound(dtype, world_size, casts=1, straight_through=band,
                         reason=f"mixed_precision reduce_dtype={dtype}: shares cast to {dtype}, divided and summed there")


def with_reduce_dtype(semantics: Semantics, scenario) -> Semantics:
    """`semantics` plus the lossy rule of `scenario`'s `reduce_dtype` (unchanged without one)."""
    dtype = scenario.options.reduce_dtype
    if not dtype:
        return semantics
    return replace(semantics, lossy=reduce_dtype_bound(dtype, scenario.world_size),
                   sources=(*semantics.sources, REDUCE_DTYPE_SOURCE))


def declared(adapter, scenario) -> Semantics:
    """The semantics `adapter` declares for `scenario` (torch DDP's when it declares none)."""
    per_scenario = getattr(adapter, "semantics_for", None)
    if callable(per_scenario):
        return per_scenario(scenario) or TORCH_DDP
    return getattr(adapter, "semantics", None) or TORCH_DDP
