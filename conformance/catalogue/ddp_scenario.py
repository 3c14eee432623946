"""How one DDP-contract scenario is made: its id, required capabilities and tolerance.

Shared by the DDP catalogue (`conformance.catalogue.ddp`) and its production-training
features (`conformance.catalogue.ddp_features`), which the DDP catalogue lists: kept apart so
that neither imports the other back.

Tolerance policy (DESIGN.md, "How the oracle judges"; `conformance.oracle.envelope`): every step is
judged from the engine's own state and every rank's share is computed with the kernels the
rank uses, so what remains is the cross-rank sum. fp32/fp64 at 1-2 ranks: bitwise (those
scenarios use small-integer data). fp32/fp64 at 3-4 ranks (continuous random data, no exact
zeros whose ReLU could flip): bitwise to one summation order of the shares. Sums rounded in
fp16/bf16 (low-precision parameters, compression hooks; a declared reduce_dtype, see
`conformance.semantics`): the bound derived from the shares, casts counted. The old bands
stay only as the straight-through check's (`Tolerance.straight_through`).
"""

from __future__ import annotations

from conformance.catalogue.profiles import QUICK
from conformance.catalogue.profiles import SHORT_DTYPE as SHORT
from conformance.spec import (
    EXACT,
    Scenario,
    Tolerance,
    WrapOptions,
    derived_bound,
    summation_order,
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
    if options.comm_hook in HOOK_BAND:
        # Cast to the hook's dtype (one rounding per share), divided and summed there.
        hook = {"fp16": "float16", "bf16": "bfloat16"}[options.comm_hook]
        tolerance = derived_bound(hook, w, casts=1, straight_through=HOOK_BAND[options.comm_hook],
                                  reason=f"{options.comm_hook} compression hook: shares cast to {hook}, summed in {hook}")
        fields.setdefault("steps", 1)
    elif options.comm_hook and dtype not in ("float16", "bfloat16"):  # half params: their own bound below
        tolerance = EXACT if w <= 2 else summation_order(dtype, w)
        fields.setdefault("steps", 1)
    elif options.reduce_dtype:
        # Continuous data, so the low-precision reduce really rounds; one step. The scenario's own
        # rule is fp32's: an engine that reduces in reduce_dtype declares it
        # (conformance.semantics.reduce_dtype_bound) and is judged by the bound derived for it.
        tolerance = summation_order("float32", w, "fp32 sums; a lower-precision reduce must be declared")
        fields.setdefault("steps", 1)
        fields.setdefault("exact_data", False)
    elif dtype in ("float16", "bfloat16"):
        tolerance = derived_bound(dtype, w, reason=f"{dtype} parameters: shares divided and summed in {dtype}")
    elif exact:
        tolerance = EXACT
    else:
        tolerance = summation_order(dtype, w)
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
