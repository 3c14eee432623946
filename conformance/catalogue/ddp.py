"""The DDP scenario catalogue.

Tolerance policy (see DESIGN.md, "Tolerance"): with world size 1 or 2 every rank's share is
computed with the same kernels as in the oracle and the cross-rank sum of two terms is
commutative, so fp32/fp64 results must be bitwise equal; those scenarios use small-integer
data. With 3 or 4 ranks the sum order differs, so they use continuous random data (no exact
zeros whose ReLU could flip on a 1-ulp difference) and a tolerance scaled by the number of
summands. Compression hooks are compared over one step with a band of two fp16/bf16 ulps.
"""

from __future__ import annotations

from conformance.catalogue import FULL, QUICK, STANDARD, training_loop
from conformance.catalogue import SHORT_DTYPE as SHORT
from conformance.spec import (
    EXACT,
    Expect,
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
# Models with parameters whose true gradient is exactly zero (attention's key bias; a conv
# bias feeding BatchNorm). With 3+ ranks the gradient is rounding noise of a different
# summation order, and Adam (which normalizes by its magnitude) turns that noise into
# full-size steps: such pairs are not a meaningful check, so Adam runs them at 1-2 ranks only.
ZERO_GRADIENT_MODELS = frozenset({"transformer", "cnn-bn"})


def scenarios(area: str = "ddp") -> list[Scenario]:
    """Every DDP-contract scenario; `area="sharded"` reuses them for sharded implementations."""
    m = lambda *a, **k: make(*a, area=area, **k)  # noqa: E731
    out = [
        # -- the basics, and construction-time sync (every model has rank-dependent init)
        m("plain", "mlp", w=1),
        m("plain", "mlp", w=2, steps=3),
        m("adam", "mlp", optimizer="adam", steps=3),
        m("plain", "mlp", w=3, steps=3, profiles=STANDARD),
        m("plain", "mlp", w=4, steps=3, profiles=STANDARD),
        m("adam", "transformer", optimizer="adam", profiles=STANDARD),
        m("plain", "transformer", profiles=STANDARD),
        m("plain", "cnn-bn", profiles=QUICK, description="per-shard BatchNorm statistics; rank 0's running stats"),
        m("plain", "cnn-bn", w=4, profiles=STANDARD),
        m("buffers", "buffered", steps=3, description="a buffer updated and used by forward: rank 0 broadcast"),
        m("buffers", "buffered", w=3, steps=3, profiles=STANDARD),
        # -- bucketing
        m("bucket-tiny", "many-tiny", options=WrapOptions(bucket_cap_mb=0.001)),
        m("bucket-tiny", "transformer", options=WrapOptions(bucket_cap_mb=0.001), profiles=STANDARD),
        m("bucket-default", "many-tiny", profiles=STANDARD),
        m("bucket-huge", "transformer", options=WrapOptions(bucket_cap_mb=1000.0), profiles=STANDARD),
        m("bucket-over-cap", "big-param", options=WrapOptions(bucket_cap_mb=0.01),
          description="one parameter larger than the bucket cap"),
        m("bucket-tiny", "many-tiny", w=4, options=WrapOptions(bucket_cap_mb=0.001), profiles=STANDARD),
        m("bucket-view", "mlp", options=WrapOptions(gradient_as_bucket_view=True), steps=3),
        m("bucket-view", "big-param", options=WrapOptions(gradient_as_bucket_view=True, bucket_cap_mb=0.01), profiles=STANDARD),
        m("bucket-view-no-sync", "mlp", options=WrapOptions(gradient_as_bucket_view=True), micro_batches=3, profiles=STANDARD),
        m("static-graph", "mlp", options=WrapOptions(static_graph=True), steps=3),
        m("static-graph", "transformer", options=WrapOptions(static_graph=True), w=3, profiles=STANDARD),
        # -- unused parameters
        m("unused-on-rank1", "branches", options=FUF, model_kwargs={"mode": "unused-on-rank1"},
          description="a parameter used on even ranks only: every rank gets the average"),
        m("unused-on-all", "branches", options=FUF, model_kwargs={"mode": "unused-all"},
          description="a parameter used by no rank keeps grad None"),
        m("unused-on-rank1", "branches", w=3, options=FUF, model_kwargs={"mode": "unused-on-rank1"}, profiles=STANDARD),
        m("unused-on-all", "branches", w=1, options=FUF, model_kwargs={"mode": "unused-all"}, profiles=STANDARD),
        m("unused-static-graph", "branches", options=WrapOptions(find_unused_parameters=True, static_graph=True),
          model_kwargs={"mode": "unused-on-rank1"}, profiles=STANDARD),
        m("unused-without-fuf", "branches", model_kwargs={"mode": "unused-no-fuf"}, expect=Expect.MATCH_OR_ERROR,
          error_pattern=r"(?i)unused|find_unused_parameters|finish(ed)? reduction",
          description="an unused parameter without find_unused_parameters: a clear error, or right answers",
          upstream="pytorch/pytorch#128949"),
        m("rank-uses-no-param", "branches", options=FUF, model_kwargs={"mode": "rank-idle"}, timeout_s=20,
          profiles=STANDARD, description="rank 1's forward uses no parameter", upstream="pytorch/pytorch#40566"),
        # -- no_sync accumulation
        m("no-sync", "mlp", micro_batches=3),
        m("no-sync", "mlp", w=3, micro_batches=2, profiles=STANDARD),
        m("no-sync-control-flow", "branches", options=FUF, micro_batches=3, model_kwargs={"mode": "micro-flow"},
          description="a parameter used only in the first (no_sync) micro-batch", upstream="pytorch/pytorch#69031"),
        m("no-sync-adam", "transformer", micro_batches=2, optimizer="adam", profiles=STANDARD),
        # -- model structure
        m("tied", "tied"),
        m("tied", "tied", w=4, profiles=STANDARD),
        m("frozen", "frozen"),
        m("mixed-dtype", "mixed-dtype"),
        m("sparse", "embedding", model_kwargs={"sparse": True}),
        m("sparse", "embedding", w=3, model_kwargs={"sparse": True}, profiles=STANDARD),
        m("dense-embedding", "embedding", profiles=STANDARD),
        # -- data
        m("uneven", "mlp", shard_sizes=(2, 6)),
        m("uneven", "mlp", w=3, shard_sizes=(1, 2, 5), profiles=STANDARD),
        m("uneven", "cnn-bn", w=4, shard_sizes=(2, 4, 2, 8), profiles=STANDARD),
        # -- precision and compression
        m("fp16-params", "mlp", dtype="float16", profiles=STANDARD),
        m("bf16-params", "mlp", dtype="bfloat16", profiles=STANDARD),
        m("fp64-params", "mlp", dtype="float64", profiles=STANDARD),
        m("hook-allreduce", "mlp", options=WrapOptions(comm_hook="allreduce"), steps=2, profiles=STANDARD),
        m("hook-fp16", "mlp", options=WrapOptions(comm_hook="fp16")),
        m("hook-bf16", "mlp", options=WrapOptions(comm_hook="bf16"), profiles=STANDARD),
        m("reduce-bf16", "mlp", options=WrapOptions(reduce_dtype="bfloat16"),
          description="mixed_precision reduce_dtype=bf16: fp32 parameters, gradients reduced in bf16 and cast back"),
        m("reduce-bf16", "mlp", w=4, options=WrapOptions(reduce_dtype="bfloat16"), profiles=STANDARD),
        m("reduce-fp16", "transformer", w=3, options=WrapOptions(reduce_dtype="float16"), profiles=STANDARD),
    ]
    if area == "ddp":  # the training-loop scenarios (conformance/catalogue/training_loop.py)
        out += training_loop.scenarios(m)
    # -- full: the core models across every world size and both optimizers
    for model in ("mlp", "transformer", "cnn-bn", "tied", "many-tiny", "mixed-dtype"):
        for w in (1, 2, 3, 4):
            for opt in ("sgd", "adam"):
                if opt == "adam" and w > 2 and model in ZERO_GRADIENT_MODELS:
                    continue
                out.append(m(f"sweep-{opt}", model, w=w, optimizer=opt, steps=3, profiles=FULL))
    for w in (1, 2, 3, 4):
        out.append(m("sweep-unused", "branches", w=w, options=FUF, model_kwargs={"mode": "unused-on-rank1"}, profiles=FULL))
        out.append(m("sweep-no-sync", "branches", w=w, options=FUF, micro_batches=3,
                     model_kwargs={"mode": "micro-flow"}, profiles=FULL))
    if area == "ddp":  # production-training features (join, AMP, compile ...): their own module
        from conformance.catalogue import ddp_features

        out += ddp_features.scenarios()
    return out
