"""How one DDP-contract scenario is made: its id, required capabilities and tolerance.

Shared by the DDP catalogue (`conformance.catalogue.ddp`) and its production-training
features (`conformance.catalogue.ddp_features`), which the DDP catalogue lists: kept apart so
that neither imports the other back.

Tolerance policy (see DESIGN.md, "Tolerance"): with world size 1 or 2 every rank's share is
computed with the same kernels as in the oracle and the cross-rank sum of two terms is
commutative, so fp32/fp64 results must be bitwise equal; those scenarios use small-integer
data. With 3 or 4 ranks the sum order differs, so they use continuous random data (no exact
zeros whose ReLU could flip on a 1-ulp difference) and a tolerance scaled by the number of
summands. Compression hooks are compared over one step with a band of two fp16/bf16 ulps.
"""

from __future__ import annotations

from conformance.catalogue.profiles import QUICK
from conformance.catalogue.profiles import SHORT_DTYPE as SHORT
from conformance.spec import (
    EXACT,
    Scenario,
    Tolerance,
    WrapOptions,
    float_tolerance,
)
from conformance.spec import (
    Capability as C,
)

HOOK_BAND = {"fp16": Tolerance(False, 2**-9, 2**-9, "fp16 compression: 2 fp16 ulps"),
             "bf16": Tolerance(False, 2**-6, 2**-6, "bf16 compression: 2 bf16 ulps")}


def _requires(options: WrapOptions, micro_batches: int, model_kwargs: dict, dtype: str) -> frozenset:
    need = set()
    if micro_batches > 1:
        need.add(C.NO_SYNC)
    if options.find_unused_parameters:
        need.add(C.FIND_UNUSED)
    if options.static_graph:
        need.add(C.STATIC_GRAPH)
    if options.gradient_as_bucket_view:
        need.add(C.GRAD_AS_BUCKET_VIEW)
    if options.comm_hook:
        need.add(C.COMM_HOOK)
    if options.reduce_dtype:
        need.add(C.MIXED_PRECISION)
    if options.bucket_cap_mb is not None:
        need.add(C.BUCKET_CAP)
    if model_kwargs.get("sparse"):
        need.add(C.SPARSE)
    if dtype in ("float16", "bfloat16"):
        need.add(C.HALF_PRECISION)
    return frozenset(need)


def make(
    name: str,
    model: str,
    *,
    w: int = 2,
    profiles: frozenset = QUICK,
    dtype: str = "float32",
    options: WrapOptions = WrapOptions(),  # noqa: B008 - frozen, immutable
    model_kwargs: dict | None = None,
    area: str = "ddp",
    **fields,
) -> Scenario:
    model_kwargs = model_kwargs or {}
    exact = w <= 2 and dtype in ("float32", "float64") and not options.comm_hook
    if options.comm_hook:
        tolerance = HOOK_BAND[options.comm_hook] if options.comm_hook in HOOK_BAND else EXACT
        fields.setdefault("steps", 1)
    elif options.reduce_dtype:
        # Continuous data, so the low-precision reduce really rounds; one step (the bound is per
        # step). The scenario's own band is fp32's: an engine that reduces in reduce_dtype
        # declares its lossy bound (conformance.semantics.reduce_dtype_bound) and is checked on it.
        tolerance = float_tolerance("float32", w, "fp32 sums; a lower-precision reduce must be declared")
        fields.setdefault("steps", 1)
        fields.setdefault("exact_data", False)
    elif dtype in ("float16", "bfloat16"):
        tolerance = float_tolerance(dtype, w, f"{dtype} parameters, sums of {w} ranks")
    elif exact:
        tolerance = EXACT
    else:
        tolerance = float_tolerance(dtype, w)
    micro = fields.get("micro_batches", 1)
    return Scenario(
        id=f"{area}/{name}/{model}/w{w}/{SHORT[dtype]}",
        area=area,
        model=model,
        model_kwargs=tuple(sorted(model_kwargs.items())),
        dtype=dtype,
        world_size=w,
        options=options,
        requires=_requires(options, micro, model_kwargs, dtype) | fields.pop("extra_requires", frozenset()),
        tolerance=fields.pop("tolerance", tolerance),
        exact_data=fields.pop("exact_data", exact or dtype in ("float16", "bfloat16") or bool(options.comm_hook)),
        profiles=profiles,
        **fields,
    )


FUF = WrapOptions(find_unused_parameters=True)
