"""The suite's shared vocabulary: scenarios, capabilities, tolerances and wrap options.

Everything here is plain, frozen, picklable data. The same `Scenario` object flows from the
CLI to the coordinator, to every rank process and into the report, so nothing in it may
refer to live objects (modules, process groups, devices handles). It prints as its id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

# The areas, each one contract the suite checks, in the order reports list them: registered in
# `conformance/areas/` (one module each), named here because a `Scenario` names its area.
from conformance.areas import NAMES as AREA_NAMES


class Capability(str, enum.Enum):
    """What an implementation must support for a scenario to apply to it.

    A scenario that needs a capability the adapter lacks is *skipped with the capability
    named*, never passed.
    """

    NO_SYNC = "no_sync"
    FIND_UNUSED = "find_unused_parameters"
    SPARSE = "sparse_gradients"
    STATIC_GRAPH = "static_graph"
    GRAD_AS_BUCKET_VIEW = "gradient_as_bucket_view"
    COMM_HOOK = "comm_hook"
    BUCKET_CAP = "bucket_cap_mb"
    BUFFER_BROADCAST = "broadcast_buffers"
    HALF_PRECISION = "half_precision"
    CUDA = "cuda"
    ENGINE_ZERO_GRAD = "engine_zero_grad"  # the wrapper has its own zero_grad(set_to_none=...)
    JOIN = "join"  # uneven inputs: the wrapper's join() context manager (torch's signature)
    # torch DDP's `mixed_precision=_MixedPrecision(reduce_dtype=...)`: gradients reduced in a lower dtype
    MIXED_PRECISION = "mixed_precision"
    # sharded engines (issue #26): per-module units of gathering (FSDP's nested wrapping) and
    # reshard_after_forward=False (FSDP1: SHARD_GRAD_OP)
    SHARD_UNITS = "shard_units"
    RESHARD = "reshard_after_forward"
    HSDP = "hsdp"  # a 2-D (replicate, shard) mesh: FSDP2 HSDP, FSDP1 HYBRID_SHARD
    # issue #26 part B: FSDP2's shard_placement_fn, its CPUOffloadPolicy, and a state-dict round
    # trip (full, or sharded through torch.distributed.checkpoint) that a rebuilt engine loads
    SHARD_PLACEMENT = "shard_placement_fn"
    CPU_OFFLOAD = "cpu_offload"
    STATE_DICT = "state_dict"
    # issue #26 part A: reshard_after_forward as an int (FSDP2: reshard to groups of that many
    # ranks after forward, all-gather within the group before backward)
    RESHARD_INT = "reshard_after_forward_int"
    # HSDP's reduce-scatter-only accumulation (FSDP2 set_requires_all_reduce(False)): micro-batches
    # reduce-scattered within the shard group, all-reduced across replicas only at the last
    HSDP_RS_ACCUMULATION = "hsdp_reduce_scatter_accumulation"

    def __str__(self) -> str:  # shows up in skip reasons
        return self.value


class Expect(str, enum.Enum):
    """What outcome a scenario accepts."""

    MATCH = "match"  # every comparison must hold
    # The implementation may instead raise a clear error (the message must match
    # `Scenario.error_pattern`), but only on every rank and never after a wrong step.
    MATCH_OR_ERROR = "match-or-error"
    # Every rank must raise an error matching `error_pattern` after the last comparison
    # (e.g. join with throw_on_early_termination); not raising is a failure.
    ERROR = "error"


@dataclass(frozen=True)
class Tolerance:
    """How the oracle's value and an implementation's are compared, and which rule applies.

    Rules (DESIGN.md, "How the oracle judges"; `conformance.oracle.envelope` builds them per element):
    - "bitwise": equal to the oracle's value (small-integer or dyadic data, at most 2 ranks:
      the cross-rank sum is order-free);
    - "summation-order": bitwise to the result of one summation order of the ranks' own
      contributions (every order for W <= 4; ring orders plus a derived bound beyond);
    - "derived-bound": |ŝ - s| <= γ_m·Σ|x_i| from the contributions, for sums rounded in
      `sum_dtype` after `roundings` declared casts per term;
    - a band (`exact=False`: rtol/atol, or a whole-tensor `norm_rtol`): the last resort, only
      where no bound can be derived (`float_tolerance`; each use names why in `reason`).
    `divide` says where the 1/W may happen ("pre": every share, torch DDP; "post": after the
    sum; "split": FSDP's pre/post factors). `straight_through` is the band of the second,
    reported check (training straight through, where rounding compounds across steps); None
    where the re-anchored steps are bitwise (then straight-through equality follows).
    """

    exact: bool = True
    rtol: float = 0.0
    atol: float = 0.0
    reason: str = "exact: small-integer data, power-of-two world size"
    # A bound on the whole tensor instead of element-wise (lossy communication, e.g. PowerSGD):
    # ||actual - expected|| <= norm_rtol * ||expected|| + atol * sqrt(numel).
    norm_rtol: float | None = None
    rule: str = "bitwise"  # with exact=True: "bitwise" | "summation-order" | "derived-bound" | "accumulated-envelope"
    sum_dtype: str | None = None  # derived-bound: the dtype the sum is rounded in (None: the tensor's)
    roundings: int = 0  # derived-bound: declared casts per term before the sum
    divide: tuple[str, ...] = ("pre",)
    straight_through: Tolerance | None = None

    @property
    def kind(self) -> str:
        """bitwise | summation-order | derived-bound | band | norm."""
        if not self.exact:
            return "norm" if self.norm_rtol is not None else "band"
        return self.rule

    def describe(self) -> str:
        kind = self.kind
        if kind == "norm":
            text = f"||error|| <= {self.norm_rtol:g}*||expected|| + {self.atol:g}*sqrt(n)"
        elif kind == "band":
            text = f"band rtol={self.rtol:g} atol={self.atol:g} (no bound derived)"
        elif kind == "summation-order":
            text = "bitwise to a summation order"
        elif kind == "accumulated-envelope":
            text = "accumulated envelope |x-s*| <= |a-s*| + w (conformance.oracle.trajectory)"
        elif kind == "derived-bound":
            casts = f", {self.roundings} cast(s) per term" if self.roundings else ""
            text = f"derived bound |ŝ-s| <= γ_m·Σ|x_i|, γ_m = m·u/(1-m·u), u of {self.sum_dtype or 'the dtype'}{casts}"
        else:
            text = "bitwise"
        if self.divide != ("pre",):
            text += f" (1/W: {'/'.join(self.divide)})"
        if self.straight_through is not None:
            text += f"; straight through: {self.straight_through.describe()}"
        return text


EXACT = Tolerance()


def float_tolerance(dtype: str, summands: int = 1, reason: str = "") -> Tolerance:
    """A blanket per-dtype band scaled for the number of summands: the last resort.

    Only where no bound can be derived (torch.compile's reordered kernels, distributed
    autograd's accumulation order, the straight-through check's compounding across steps).
    Rounding error of a sum of n terms grows at most like n * eps; it allows 16 * n * eps
    relative error and 8x that in absolute terms for values near zero.
    """
    eps = {"float32": 2.0**-23, "float64": 2.0**-52, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    scale = 16 * max(1, summands) * eps
    # atol covers elements that cancel to near zero; the zoo's values are O(1..10).
    return Tolerance(False, rtol=scale, atol=8 * scale, reason=reason or f"{dtype}, sums of {summands} ranks in another order")


def summation_order(dtype: str, world_size: int, reason: str = "", divide: tuple[str, ...] = ("pre",)) -> Tolerance:
    """Full-precision cross-rank sums: bitwise to one summation order of the ranks' contributions.

    At most two ranks the sum is order-free: "bitwise". The straight-through check keeps the
    summand-scaled band (rounding compounds across steps there; no bound is derived for it).
    """
    if world_size <= 2 and divide == ("pre",):
        return Tolerance(True, reason=reason or "exact: the sum of at most two shares is order-free")
    return Tolerance(True, rule="summation-order", divide=divide,
                     reason=reason or f"{dtype}: sums of {world_size} ranks in an order the backend picks",
                     straight_through=float_tolerance(dtype, world_size, f"{dtype}: rounding compounds over steps"))


def derived_bound(sum_dtype: str, world_size: int, casts: int = 0, reason: str = "",
                  straight_through: Tolerance | None = None, divide: tuple[str, ...] = ("pre",)) -> Tolerance:
    """A sum rounded in `sum_dtype` (low-precision parameters, a declared reduce_dtype, a
    compression hook), `casts` roundings per term before it: the bound derived per element."""
    return Tolerance(True, rule="derived-bound", sum_dtype=sum_dtype, roundings=casts, divide=divide,
                     reason=reason or f"sums of {world_size} ranks rounded in {sum_dtype}",
                     straight_through=straight_through or float_tolerance(
                         sum_dtype, world_size, f"{sum_dtype}: rounding compounds over steps"))


@dataclass(frozen=True)
class WrapOptions:
    """Options passed to the implementation's constructor (torch DDP's keyword names)."""

    bucket_cap_mb: float | None = None  # None: the implementation's default
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    broadcast_buffers: bool = True
    comm_hook: str | None = None  # "allreduce" | "fp16" | "bf16"
    # mixed_precision=_MixedPrecision(reduce_dtype=<this dtype>): "bfloat16" | "float16"
    reduce_dtype: str | None = None
    # sharded engines (issue #26): "children" makes each block a unit of its own (a ModuleList's
    # items, else each direct child with parameters); reshard_after_forward False keeps a unit's
    # parameters gathered from its forward to the end of backward. None: the engine's default.
    units: str | None = None
    reshard_after_forward: bool | int | None = None  # an int: FSDP2's group size to reshard to
    hsdp_replicas: int | None = None  # HSDP: the replicate dimension of a (replicas, W // replicas) mesh
    # HSDP only: inside no_sync() each micro-batch is reduce-scattered within the shard group and
    # accumulated there; the synced backward all-reduces the sum across replicas (FSDP2
    # set_requires_all_reduce(False); the oracle's tree: conformance.oracle.envelope.staged_reduce)
    accumulate_reduce_scattered: bool = False
    # FSDP2's shard_placement_fn: "dim1-if-even" shards a 2-D parameter on dim 1 where the world
    # size divides that dim, else the default dim 0 (conformance.judge.shards.placement_dim)
    shard_placement: str | None = None
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy (pin_memory only on CUDA), FSDP1 CPUOffload
    # sharded engines' mixed-precision policy (FSDP2 MixedPrecisionPolicy, FSDP1 MixedPrecision,
    # refimpl ZeRO-3): compute in param_dtype from fp32 masters, reduce in reduce_dtype above
    # (None: param_dtype), gradients cast back to the masters' dtype (conformance.oracle.baseline_mixed)
    param_dtype: str | None = None

    def describe(self) -> str:
        parts = []
        defaults = WrapOptions()
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value != getattr(defaults, name):
                parts.append(f"{name}={value}")
        return ", ".join(parts) or "defaults"


@dataclass(frozen=True)
class Scenario:
    """One multi-process (or single-process, for data_parallel) check of the contract.

    `shard_sizes[r]` is rank r's local batch size (unequal sizes model uneven shards);
    `micro_batches` > 1 runs the first micro-batches of each step under `no_sync()`.
    """

    id: str
    area: str
    model: str
    model_kwargs: tuple[tuple[str, Any], ...] = ()
    dtype: str = "float32"
    device: str = "cpu"
    world_size: int = 2
    shard_sizes: tuple[int, ...] = ()
    steps: int = 2
    micro_batches: int = 1
    optimizer: str = "sgd"  # "sgd" | "adam" | "none"
    options: WrapOptions = field(default_factory=WrapOptions)
    requires: frozenset[Capability] = frozenset()
    tolerance: Tolerance = EXACT
    seed: int = 0
    exact_data: bool = True  # small-integer inputs and weights
    expect: Expect = Expect.MATCH
    error_pattern: str = ""  # regex an accepted error must match (Expect.MATCH_OR_ERROR)
    buffer_rule: str = "rank0-broadcast"  # how buffers are checked: "rank0-broadcast" | "none"
    profiles: frozenset[str] = frozenset({"full"})
    timeout_s: float = 60.0
    description: str = ""
    upstream: str = ""  # e.g. "pytorch/pytorch#128949" when the scenario exists for a known bug
    clauses: tuple[str, ...] = ()  # contract clauses it checks (docs/contracts/<area>.md), e.g. ("B3",)
    # How gradients are cleared after each step (see conformance.runners.ddp): "optimizer"
    # (optimizer.zero_grad(set_to_none=True), torch 2.x's default), "alternate" (set_to_none
    # True on even steps, False on odd ones) or "engine" (the wrapper's own zero_grad).
    zero_grad: str = "optimizer"
    # Rank-skewed timing: the last rank sleeps before "backward" or before the optimizer "step",
    # so collectives arrive out of lockstep. "" for none.
    skew: str = ""
    # Production-training features the rank loop turns on (conformance.features): join,
    # autocast, GradScaler, compile, clipping, requires_grad toggles, checkpoint round trip.
    features: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.area not in AREA_NAMES:
            raise ValueError(f"scenario {self.id}: unknown area {self.area!r}; one of {AREA_NAMES}")
        if self.world_size < 1:
            raise ValueError(f"scenario {self.id}: world_size must be >= 1")
        if self.zero_grad not in ("optimizer", "alternate", "engine"):
            raise ValueError(f"scenario {self.id}: zero_grad must be optimizer, alternate or engine")
        if self.skew not in ("", "backward", "step"):
            raise ValueError(f"scenario {self.id}: skew must be '', backward or step")
        if self.shard_sizes and len(self.shard_sizes) != self.world_size:
            raise ValueError(
                f"scenario {self.id}: {len(self.shard_sizes)} shard sizes for world size {self.world_size}"
            )

    def __str__(self) -> str:
        return self.id

    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_kwargs)

    def shard_size(self, rank: int) -> int:
        return self.shard_sizes[rank] if self.shard_sizes else 4

    def with_(self, **changes: Any) -> Scenario:
        return replace(self, **changes)
