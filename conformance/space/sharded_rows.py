"""A row of the sharded scenario space (`conformance.space.sharded`) as a `Scenario`, and back.

`scenario(row)` builds what the sharded rank loops and oracles run, with the tolerance rules the
hand-written sharded families use (`conformance.catalogue.sharded*`): bitwise at 1-2 ranks, a
summation order beyond, the derived bound of a low-precision sum, the mixed-precision policy's
rule, the clip bound; every placement of 1/W a sharded engine may use. Its id says every value
that is not the dimension's default, e.g. ``sharded/pairs/uneven/w4/mp-fp32/mesh-hsdp+clip-below``.
`project(scenario)` reads a hand-written sharded scenario as a row, so the pinned catalogue counts
towards coverage.
"""

from __future__ import annotations

from dataclasses import replace

from conformance.catalogue.ddp_scenario import make
from conformance.catalogue.sharded_clauses import clauses_of
from conformance.catalogue.sharded_precision import mp_tolerance
from conformance.space.sharded import DIMENSIONS, FULL_VALUES, HALF, LARGE_SCALE, MODELS, TINY_SCALE
from conformance.spec import Capability as C
from conformance.spec import Scenario, WrapOptions, float_tolerance

DEFAULTS = {d.name: d.values[0] for d in DIMENSIONS}
DTYPE = {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16", "fp16": "float16",
         "mp-fp32": "float32", "mp-bf16": "float32"}
MP_REDUCE = {"mp-fp32": "float32", "mp-bf16": "bfloat16"}
RESHARD = {"on": None, "off": False, "to-2": 2}
CLIP = {"below": 2.0**-8, "above": 2.0**20}  # far below / far above every model's gradient norm here
DIVIDE = ("pre", "post", "split")  # where sharded engines may place 1/W (conformance.oracle.envelope)
SHORT = {"accumulation": "accum", "state_dict": "sd", "optimizer": "opt"}
UNEVEN = (2, 6, 1, 5, 3, 7, 2, 4)


def _id(row: dict, tag: str) -> str:
    head = f"sharded/{tag}/{row['model']}/w{row['world']}/{row['precision']}"
    rest = [f"{SHORT.get(k, k)}-{v}" for k, v in row.items()
            if k not in ("model", "world", "precision") and v != DEFAULTS[k]]
    return head + ("/" + "+".join(rest) if rest else "")


def _options(row: dict) -> tuple[WrapOptions, set]:
    """The engine options a row asks for, and the capabilities they need."""
    need = set()
    mp = row["precision"] in MP_REDUCE
    options = WrapOptions(
        find_unused_parameters="unused" in MODELS[row["model"]][2],
        units="children" if row["units"] == "children" else None,
        reshard_after_forward=RESHARD[row["reshard"]],
        hsdp_replicas=2 if row["mesh"] == "hsdp" else None,
        accumulate_reduce_scattered=row["accumulation"] == "rs-2",
        shard_placement="dim1-if-even" if row["placement"] == "dim1" else None,
        cpu_offload=row["offload"] == "on",
        param_dtype="bfloat16" if mp else None,
        reduce_dtype=MP_REDUCE.get(row["precision"]),
    )
    for wanted, capability in ((options.units, C.SHARD_UNITS), (row["reshard"] == "off", C.RESHARD),
                               (row["reshard"] == "to-2", C.RESHARD_INT), (options.hsdp_replicas, C.HSDP),
                               (options.accumulate_reduce_scattered, C.HSDP_RS_ACCUMULATION),
                               (options.shard_placement, C.SHARD_PLACEMENT), (options.cpu_offload, C.CPU_OFFLOAD),
                               (mp, C.MIXED_PRECISION)):
        if wanted:
            need.add(capability)
    return options, need


def _clauses(row: dict, s: Scenario) -> tuple[str, ...]:
    extra = {"S13"} if row["units"] != "root" or row["reshard"] != "on" or row["mesh"] != "flat" else set()
    for dim, clause in (("state_dict", "S16"), ("offload", "S17"), ("placement", "S18"), ("clip", "S22")):
        if row[dim] != DEFAULTS[dim]:
            extra.add(clause)
    extra |= {"S19"} if row["precision"] in MP_REDUCE else set()
    extra |= {"S20"} if row["reshard"] == "to-2" else set()
    extra |= {"S21"} if row["accumulation"] == "rs-2" else set()
    return tuple(sorted(set(clauses_of(s)) | extra, key=lambda x: int(x[1:])))


def scenario(row: dict, profiles: frozenset, tag: str = "pairs") -> Scenario:
    """The scenario one row of the covering array describes."""
    model, kwargs, _ = MODELS[row["model"]]
    kwargs = dict(kwargs)
    w, precision = row["world"], row["precision"]
    if row["data"] in ("large", "tiny"):  # exponents of two (conformance.models.data: data_scale)
        kwargs["data_scale"] = LARGE_SCALE[row["model"]] if row["data"] == "large" else TINY_SCALE
    options, need = _options(row)
    features: dict = {}
    steps = 2
    if row["clip"] != "off":
        features["clip"] = CLIP[row["clip"]]
        steps = 3
    if row["state_dict"] != "off":
        twice = row["state_dict"].endswith("-twice")
        features["save_load_at"] = (2, 4) if twice else 2
        features["state_dict"] = row["state_dict"].removesuffix("-twice")
        steps = 5 if twice else 3
        need.add(C.STATE_DICT)
    # Half parameters or a bf16 reduce past 2 ranks: judged on one step, re-anchored (their rounding
    # compounds over steps with no bound derived for the straight-through check)
    one_step = (precision in HALF or precision == "mp-bf16") and w > 2
    if one_step:
        steps = 1
    kw = {}
    if precision in MP_REDUCE:
        kw["tolerance"] = mp_tolerance(MP_REDUCE[precision], w)
    s = make(row["model"], model, w=w, area="sharded", profiles=profiles, dtype=DTYPE[precision], options=options,
             model_kwargs=kwargs, steps=steps, micro_batches=1 if row["accumulation"] == "1" else 2,
             optimizer=row["optimizer"], exact_data=row["data"] != "cont",
             shard_sizes=UNEVEN[:w] if row["shards"] == "uneven" else (), features=tuple(sorted(features.items())),
             extra_requires=frozenset(need),
             description="generated: " + ", ".join(f"{k}={v}" for k, v in row.items() if v != DEFAULTS[k]), **kw)
    tol = s.tolerance
    if tol.kind in ("summation-order", "derived-bound"):
        tol = replace(tol, divide=DIVIDE)
    if row["clip"] != "off":  # the clip family's rule (conformance.catalogue.sharded_clip)
        compute = "bfloat16" if precision in MP_REDUCE else s.dtype  # a policy's bf16 compute rounds the step
        band = float_tolerance(compute, max(w, 2), "a reordered global norm's clip coefficient, compounding over steps")
        tol = replace(tol, straight_through=band, reason=f"{tol.reason}; the clipped step's parameters: the bound "
                      "derived for a reordered global norm (conformance.oracle.clip_bound)")
    if one_step and tol.kind in ("derived-bound", "summation-order"):
        # One step: the straight-through oracle starts from the state the re-anchored one verified
        # (construction), so it adds nothing (as for the DDP space's one-step rows).
        tol = replace(tol, straight_through=None)
    s = s.with_(tolerance=tol)
    return replace(s, id=_id(row, tag), clauses=_clauses(row, s))


def project(s: Scenario) -> dict | None:
    """A hand-written sharded scenario as a row of the space; None where a value is outside it."""
    if s.area != "sharded":
        return None
    kwargs = dict(s.model_kwargs)
    scale = kwargs.pop("data_scale", None)
    model = next((name for name, (zoo, kw, _) in MODELS.items() if zoo == s.model and kwargs == kw), None)
    feats = dict(s.features)
    o = s.options
    precision = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16"}.get(s.dtype)
    if o.param_dtype:
        precision = {("bfloat16", "float32"): "mp-fp32", ("bfloat16", "bfloat16"): "mp-bf16"}.get(
            (o.param_dtype, o.reduce_dtype))
    if model is None or precision is None or set(feats) - {"clip", "save_load_at", "state_dict"}:
        return None
    if s.zero_grad != "optimizer" or s.skew or s.expect.value != "match":
        return None
    reshard = {None: "on", True: "on", False: "off", 2: "to-2"}.get(o.reshard_after_forward)
    row = {
        "model": model, "world": s.world_size, "precision": precision,
        "mesh": {None: "flat", 2: "hsdp"}.get(o.hsdp_replicas), "units": "children" if o.units else "root",
        "reshard": reshard, "placement": "dim1" if o.shard_placement else "dim0",
        "offload": "on" if o.cpu_offload else "off",
        "data": "large" if scale and scale > 0 else "tiny" if scale else "int" if s.exact_data else "cont",
        "accumulation": {1: "1", 2: "rs-2" if o.accumulate_reduce_scattered else "2"}.get(s.micro_batches),
        "clip": "off" if feats.get("clip") is None else "below" if feats["clip"] < 2**10 else "above",
        "state_dict": _state_dict(feats), "optimizer": s.optimizer,
        "shards": "uneven" if s.shard_sizes and len(set(s.shard_sizes)) > 1 else "even",
    }
    # full's values too (world size 8, offload): a full row reads back, so full's coverage counts it
    allowed = {d.name: FULL_VALUES.get(d.name, d.values) for d in DIMENSIONS}
    return {k: row[k] for k in allowed} if all(row[k] in allowed[k] for k in allowed) else None


def _state_dict(feats: dict) -> str | None:
    kind, at = feats.get("state_dict"), feats.get("save_load_at")
    if not kind and at is None:
        return "off"
    if at == 2:
        return kind
    return f"{kind}-twice" if at == (2, 4) else None
