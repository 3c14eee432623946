"""A row of the DDP scenario space (`conformance.space.ddp`) as a `Scenario`, and back.

`scenario(row)` builds what the existing rank loops and oracles run (the DDP catalogue's maker
picks the tolerance rule from the dtype, world size and options); its id says every value that
is not the dimension's default, e.g. ``ddp/pairs/tied/w3/bf16/data-large+hook-fp16+accum-2``.
`project(scenario)` reads a hand-written scenario as a row, so the pinned catalogue counts
towards coverage and the generator only adds rows for the pairs it leaves uncovered.
"""

from __future__ import annotations

from dataclasses import replace

from conformance.catalogue.ddp_features import _amp_band
from conformance.catalogue.ddp_scenario import make
from conformance.catalogue.profiles import SHORT_DTYPE
from conformance.space.ddp import DIMENSIONS, FULL_VALUES, LARGE_SCALE, MODELS, TINY_SCALE
from conformance.spec import Capability as C
from conformance.spec import Scenario, WrapOptions, float_tolerance

DEFAULTS = {d.name: d.values[0] for d in DIMENSIONS}
DTYPE = {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16", "fp16": "float16",
         "amp-bf16": "float32", "amp-fp16": "float32"}
AUTOCAST = {"amp-bf16": "bfloat16", "amp-fp16": "float16"}
BUCKET_CAP = {"default": None, "tiny": 0.001, "huge": 1000.0}
CLIP = {"below": 2.0**-8, "above": 2.0**20}  # far below / far above every model's gradient norm here
SHORT = {"find_unused": "fuf", "static_graph": "static", "broadcast_buffers": "bcast", "bucket_view": "view",
         "bucket_cap": "cap", "reduce_dtype": "reduce", "accumulation": "accum", "activation_ckpt": "ckpt",
         "round_trip": "resume", "zero_grad": "zg", "optimizer": "opt", "build_order": "build",
         "resume_order": "reload"}
UNEVEN = (2, 6, 1, 5, 3, 7, 2, 4)


def _join_counts(kind: str, w: int) -> tuple[int, ...]:
    """Per-rank batch counts: every rank at least one step apart from another."""
    if kind == "uneven":
        return tuple(5 - (r % 3) for r in range(w))
    if kind == "zero-batches":
        return tuple(0 if r == w - 1 else 5 - (r % 2) for r in range(w))
    return tuple(2 if r == 0 else 5 for r in range(w))  # rank0-first


def _id(row: dict, profile_tag: str) -> str:
    head = f"ddp/{profile_tag}/{row['model']}/w{row['world']}/{row['precision']}"
    rest = [f"{SHORT.get(k, k)}-{_word(v)}" for k, v in row.items()
            if k not in ("model", "world", "precision") and v != DEFAULTS[k]]
    return head + ("/" + "+".join(rest) if rest else "")


def _word(value) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def scenario(row: dict, profiles: frozenset, tag: str = "pairs") -> Scenario:
    """The scenario one row of the covering array describes."""
    model, kwargs, _ = MODELS[row["model"]]
    kwargs = dict(kwargs)
    w, precision = row["world"], row["precision"]
    features: dict = {}
    if precision in AUTOCAST:
        features["autocast"] = AUTOCAST[precision]
        features["grad_scaler"] = precision == "amp-fp16"
    if row["data"] in ("large", "tiny"):  # exponents of two (conformance.models.data: data_scale)
        kwargs["data_scale"] = LARGE_SCALE[row["model"]] if row["data"] == "large" else TINY_SCALE
    micro = {"1": 1, "2": 2, "3": 3, "split": 3}[row["accumulation"]]
    if row["accumulation"] == "split":
        kwargs["no_sync_split"] = True
    # Two steps: the second backward runs on rebuilt buckets after a step; an alternating
    # zero_grad shows only at the third; the production features run three (a round trip twice: 5).
    steps = 3 if row["zero_grad"] != "optimizer" else 2
    extra = set()
    if row["join"] != "off":
        features["join"] = _join_counts(row["join"], w)
        steps = max(features["join"])
        extra.add(C.JOIN)
    if row["clip"] != "off":
        features["clip"] = CLIP[row["clip"]]
    if row["activation_ckpt"] != "off":
        features["checkpoint"] = row["activation_ckpt"]
    if row["compile"] != "off":
        features["compile"] = row["compile"]
    if row["round_trip"] != "off":
        features["save_load_at"] = 2 if row["round_trip"] == "once" else (2, 4)
        steps = max(steps, 3 if row["round_trip"] == "once" else 5)
        if row["resume_order"] != "wrap-load":
            features["resume_order"] = row["resume_order"]
    if row["build_order"] != "wrap-first":
        kwargs["build_order"] = row["build_order"]
    if features:
        steps = max(steps, 3)
    if row["hook"] in ("fp16", "bf16") or row["reduce_dtype"] != "none":
        steps = 1  # judged re-anchored on one step (the constraint lossy-reduce-one-step)
    if not row["broadcast_buffers"]:
        extra.add(C.BUFFER_BROADCAST)
    if row["zero_grad"] == "engine":
        extra.add(C.ENGINE_ZERO_GRAD)
    options = WrapOptions(
        bucket_cap_mb=BUCKET_CAP[row["bucket_cap"]], find_unused_parameters=row["find_unused"],
        gradient_as_bucket_view=row["bucket_view"], static_graph=row["static_graph"],
        broadcast_buffers=row["broadcast_buffers"], comm_hook=None if row["hook"] == "none" else row["hook"],
        reduce_dtype=None if row["reduce_dtype"] == "none" else DTYPE[row["reduce_dtype"]],
    )
    s = make(row["model"], model, w=w, profiles=profiles, dtype=DTYPE[precision], options=options,
             model_kwargs=kwargs, steps=steps, micro_batches=micro, optimizer=row["optimizer"],
             exact_data=row["data"] != "cont", zero_grad=row["zero_grad"], skew="" if row["skew"] == "none" else row["skew"],
             shard_sizes=UNEVEN[:w] if row["shards"] == "uneven" else (), features=tuple(sorted(features.items())),
             extra_requires=frozenset(extra), timeout_s=180.0 if row["compile"] != "off" else 60.0,
             description="generated: " + ", ".join(f"{k}={v}" for k, v in row.items() if v != DEFAULTS[k]))
    if row["compile"] != "off":
        s = s.with_(tolerance=float_tolerance("float32", max(w, 2), "torch.compile (aot_eager): reductions may be reordered"))
    s = _amp_band(s)
    if steps == 1 and s.tolerance.kind in ("derived-bound", "summation-order"):
        # One step: the straight-through oracle starts from the state the re-anchored one verified
        # (construction), so it adds nothing; its band (narrower than the derived bound where
        # shares cancel) would fail a correct engine. The straight-through check is implied.
        s = s.with_(tolerance=replace(s.tolerance, straight_through=None))
    return replace(s, id=_id(row, tag))


def project(s: Scenario) -> dict | None:
    """A hand-written DDP scenario as a row of the space; None where a value is outside it."""
    if s.area != "ddp":
        return None
    kwargs = dict(s.model_kwargs)
    model = next((name for name, (zoo, kw, _) in MODELS.items()
                  if zoo == s.model and all(kwargs.get(k) == v for k, v in kw.items())), None)
    feats = dict(s.features)
    precision = ({"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16"}.get(s.dtype)
                 if "autocast" not in feats else f"amp-{SHORT_DTYPE[feats['autocast']]}")
    if model is None or precision is None or (precision == "amp-fp16") != bool(feats.get("grad_scaler")):
        return None
    if feats.get("grad_scaler") and precision == "amp-bf16" or feats.get("freeze"):
        return None
    o = s.options
    scale = kwargs.get("data_scale")
    row = {
        "model": model, "world": s.world_size, "precision": precision,
        "data": "large" if scale and scale > 0 else "tiny" if scale else "int" if s.exact_data else "cont",
        "find_unused": o.find_unused_parameters, "static_graph": o.static_graph,
        "broadcast_buffers": o.broadcast_buffers, "bucket_view": o.gradient_as_bucket_view,
        "bucket_cap": {v: k for k, v in BUCKET_CAP.items()}.get(o.bucket_cap_mb),
        "hook": o.comm_hook or "none",
        "reduce_dtype": {None: "none", "bfloat16": "bf16", "float16": "fp16"}.get(o.reduce_dtype),
        "accumulation": "split" if kwargs.get("no_sync_split") else str(s.micro_batches),
        "join": _join_kind(feats.get("join")),
        "clip": "off" if feats.get("clip") is None else "below" if feats["clip"] < 2**10 else "above",
        "activation_ckpt": feats.get("checkpoint") or "off",
        "compile": feats.get("compile") or "off",
        "round_trip": {None: "off"}.get(feats.get("save_load_at"), "twice" if isinstance(feats.get("save_load_at"), tuple) else "once"),
        "zero_grad": s.zero_grad, "optimizer": s.optimizer, "skew": s.skew or "none",
        "shards": "uneven" if s.shard_sizes and len(set(s.shard_sizes)) > 1 else "even",
        "build_order": kwargs.get("build_order", "wrap-first"), "resume_order": feats.get("resume_order") or "wrap-load",
    }
    # full's values too (world size 8, compile): a full row reads back, so full's coverage counts it
    allowed = {d.name: FULL_VALUES.get(d.name, d.values) for d in DIMENSIONS}
    return row if all(row[k] in allowed[k] for k in allowed) else None


def _join_kind(counts) -> str:
    if not counts:
        return "off"
    if 0 in counts:
        return "zero-batches"
    return "rank0-first" if counts[0] == min(counts) and counts.count(min(counts)) == 1 else "uneven"
