"""The DDP area's scenario space: its dimensions, their values, and the constraints between them.

Plain data (DESIGN.md, "The scenario space"): `conformance.space.ddp_rows` turns a row of the
covering array into a `Scenario`, `conformance.space.profiles` generates the profiles. Each
dimension lists its values in order; the first is the default (what a hand-written scenario
that does not mention the dimension has). Values that the suite cannot run yet are not listed;
`LEFT_OUT` says which and why.

Constraints are of two kinds, both named with their reason and listed by the coverage report:
*meaning* (a combination that is not a thing: activation checkpointing needs a model with
checkpointed segments) and *not modelled* (the oracle cannot compose the two rules yet: the pair
is excluded, never judged by a band).
"""

from __future__ import annotations

from conformance.space.covering import Constraint, Dimension

# model value -> (zoo model, model kwargs, traits). The realistic models (GPT, Llama, MoE,
# ResNet: conformance.models) join here as values with their traits.
MODELS: dict[str, tuple[str, dict, frozenset[str]]] = {
    "mlp": ("mlp", {}, frozenset()),
    "transformer": ("transformer", {}, frozenset({"zero-gradient"})),
    "cnn-bn": ("cnn-bn", {}, frozenset({"buffers", "zero-gradient"})),
    "buffered": ("buffered", {}, frozenset({"buffers", "buffers-in-forward"})),
    "unused": ("branches", {"mode": "unused-on-rank1"}, frozenset({"unused"})),
    "tied": ("tied", {}, frozenset()),
    "sparse": ("embedding", {"sparse": True}, frozenset({"sparse", "index-input"})),
    "mixed-dtype": ("mixed-dtype", {}, frozenset({"fp64-layer"})),
    "many-tiny": ("many-tiny", {}, frozenset()),
    "ckpt-mlp": ("ckpt-mlp", {}, frozenset({"checkpointable"})),
}

# data=large: the inputs' power-of-two factor that brings each model's largest gradient near 2**14
# (int data): a sum of shares overflows fp16 where a share divided first does not. Models that
# normalize their inputs (LayerNorm, BatchNorm) have no large regime.
LARGE_SCALE = {"mlp": 7, "buffered": 10, "unused": 8, "tied": 3, "mixed-dtype": 6, "many-tiny": 10, "ckpt-mlp": 4}
TINY_SCALE = -10

HALF = ("bf16", "fp16")
AMP = ("amp-bf16", "amp-fp16")
FP16ISH = ("fp16", "amp-fp16")  # precisions whose forward or gradients live in fp16's range

DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("model", tuple(MODELS), "buffers, unused (rank-dependent) parameters, tied, sparse, mixed dtypes"),
    Dimension("world", (2, 1, 3, 4), "world size (8 in full)"),
    Dimension("precision", ("fp32", "fp64", "bf16", "fp16", "amp-bf16", "amp-fp16"),
              "parameter dtype, or autocast (fp16: with a GradScaler)"),
    Dimension("data", ("int", "cont", "large", "tiny"),
              "small-integer weights / continuous weights / inputs x2**7 / inputs x2**-10"),
    Dimension("find_unused", (False, True)),
    Dimension("static_graph", (False, True)),
    Dimension("broadcast_buffers", (True, False)),
    Dimension("bucket_view", (False, True), "gradient_as_bucket_view"),
    Dimension("bucket_cap", ("default", "tiny", "huge"), "bucket_cap_mb: default, 0.001, 1000"),
    Dimension("hook", ("none", "allreduce", "fp16", "bf16"), "comm hook"),
    Dimension("reduce_dtype", ("none", "bf16", "fp16"), "mixed_precision reduce_dtype"),
    Dimension("accumulation", ("1", "2", "3", "split"),
              "micro-batches per step (the first under no_sync); split: forwards inside no_sync, backward outside"),
    Dimension("join", ("off", "uneven", "zero-batches", "rank0-first"), "uneven inputs under join()"),
    Dimension("clip", ("off", "below", "above"), "clip_grad_norm_ far below / far above the gradient norm"),
    Dimension("activation_ckpt", ("off", "non-reentrant", "reentrant")),
    Dimension("compile", ("off",), "torch.compile (aot_eager) around the model or the wrapper, or compiled "
              "autograd: full only"),
    Dimension("round_trip", ("off", "once", "twice"), "checkpoint save, rebuild, load mid-run"),
    Dimension("zero_grad", ("optimizer", "alternate", "engine"), "set_to_none=True / alternating / the engine's"),
    Dimension("optimizer", ("sgd", "adam", "adamw", "sgd-wd", "adam-foreach", "adam-fused", "none", "muon"),
              "sgd: momentum 0.5; sgd-wd: momentum, nesterov and weight decay; none: gradients accumulate; "
              "muon: torch.optim.Muon on the 2-D weights, AdamW on the rest"),
    Dimension("skew", ("none", "backward", "step"), "the last rank sleeps before backward / the step"),
    Dimension("shards", ("even", "uneven"), "per-rank batch sizes"),
    # the orders a user's loop is written in (conformance.runners.build_order)
    Dimension("build_order", ("wrap-first", "optimizer-first"),
              "the optimizer built over the wrapper's parameters after wrapping / over the module's before"),
    Dimension("resume_order", ("wrap-load", "load-wrap", "optimizer-late"),
              "a round trip loads the wrapper's state after wrapping / the module's before / the optimizer's "
              "state after the first backward"),
)

# full adds world size 8 (on a CPU host, 8 ranks of gloo are slow; standard stops at 4).
# compile's pairs are generated in full only: a compiled case costs 5-30 s here, and standard
# keeps its budget (its pinned compile scenarios stay).
FULL_VALUES = {"world": (2, 1, 3, 4, 8), "compile": ("off", "model", "wrapper", "compiled-autograd")}

LEFT_OUT = {
    "hook=powersgd": "PowerSGD is an adapter (torch-ddp-powersgd, its oracle simulates the algorithm with the "
                     "engine's state), not a scenario option every engine could be asked for",
    "model=sparse-unused (a sparse embedding one rank does not use, find_unused_parameters)": "torch DDP's "
        "reducer refuses it (reducer.cpp, mark_variable_ready_sparse: 'Expected sparse gradient to be defined.' on "
        "the rank that did not use the embedding, while its peers block in the all-reduce), so each of its rows "
        "would be a hang of the reference engine until the task's timeout; refimpl averages, as the contract says",
}


def _plain_loop(a) -> bool:
    """Whether a row runs in the plain rank loop (no production-training feature)."""
    return (a["precision"] not in AMP and a["join"] == "off" and a["clip"] == "off"
            and a["activation_ckpt"] == "off" and a["compile"] == "off" and a["round_trip"] == "off")


FEATURE_DIMS = ("precision", "join", "clip", "activation_ckpt", "compile", "round_trip")


def _c(name: str, reason: str, reads: tuple[str, ...], allows) -> Constraint:
    return Constraint(name, reason, reads, allows)


def _trait(a, trait: str) -> bool:
    return trait in MODELS[a["model"]][2]


CONSTRAINTS: tuple[Constraint, ...] = (
    # -- meaning
    _c("unused-needs-find-unused", "a parameter some rank leaves unused needs find_unused_parameters (without it: "
       "the pinned unused-without-fuf scenario)", ("model", "find_unused"),
       lambda a: not _trait(a, "unused") or a["find_unused"]),
    _c("checkpointing-needs-segments", "activation checkpointing runs in the model with checkpointed segments",
       ("model", "activation_ckpt"), lambda a: (a["activation_ckpt"] == "off") or a["model"] == "ckpt-mlp"),
    _c("join-needs-ranks", "uneven inputs under join() need two ranks or more", ("join", "world"),
       lambda a: a["join"] == "off" or a["world"] >= 2),
    _c("uneven-needs-ranks", "uneven shards need two ranks or more", ("shards", "world"),
       lambda a: a["shards"] == "even" or a["world"] >= 2),
    _c("skew-needs-ranks", "timing skew needs a second rank to be out of step with", ("skew", "world"),
       lambda a: a["skew"] == "none" or a["world"] >= 2),
    _c("index-inputs-unscaled", "the embedding's inputs are indices: there is no magnitude to scale",
       ("model", "data"), lambda a: not _trait(a, "index-input") or a["data"] in ("int", "cont")),
    _c("normalized-inputs-unscaled", "LayerNorm/BatchNorm normalize the inputs' scale away: no large regime",
       ("model", "data"), lambda a: a["data"] != "large" or a["model"] in LARGE_SCALE),
    _c("static-graph-fixed", "static_graph needs a graph that does not change between iterations (join() "
       "shadows the graph, split forwards change it)", ("static_graph", "join", "accumulation"),
       lambda a: not a["static_graph"] or (a["join"] == "off" and a["accumulation"] != "split")),
    _c("clip-needs-optimizer", "clipping, a GradScaler and a checkpoint round trip act on an optimizer step",
       ("optimizer", "clip", "precision", "round_trip"),
       lambda a: a["optimizer"] != "none" or (a["clip"] == "off" and a["precision"] != "amp-fp16"
                                              and a["round_trip"] == "off")),
    _c("no-optimizer-no-clearing", "without an optimizer nothing clears the gradients (they accumulate across "
       "steps): the zero_grad style does not apply", ("optimizer", "zero_grad"),
       lambda a: a["optimizer"] != "none" or a["zero_grad"] == "optimizer"),
    # -- not modelled yet (the oracle cannot compose these; excluded, never judged by a band)
    _c("hook-or-reduce-dtype", "a comm hook and a mixed-precision reduce_dtype both decide what is reduced; the "
       "oracle composes one of them", ("hook", "reduce_dtype"),
       lambda a: a["hook"] == "none" or a["reduce_dtype"] == "none"),
    _c("low-precision-reduce-fp32", "compression hooks and reduce_dtype are judged by a bound derived for fp32 "
       "shares; other parameter dtypes' casts are not counted", ("hook", "reduce_dtype", "precision", "model"),
       lambda a: (a["hook"] in ("none", "allreduce") and a["reduce_dtype"] == "none")
       or (a["precision"] in ("fp32", "amp-bf16", "amp-fp16") and not _trait(a, "fp64-layer"))),
    _c("fp16-subnormals", "tiny values in fp16 fall into subnormals, where the relative bound does not hold",
       ("data", "precision", "hook", "reduce_dtype"),
       lambda a: a["data"] != "tiny" or not (a["precision"] in FP16ISH or a["hook"] == "fp16"
                                             or a["reduce_dtype"] == "fp16")),
    _c("fp16-overflow", "large values overflow fp16 in the forward itself, for every engine (inf compares as "
       "nothing)", ("data", "precision"), lambda a: a["data"] != "large" or a["precision"] not in FP16ISH),
    _c("loop-features-plain", "the zero_grad style and timing skew are switches of the plain rank loop; the "
       "production-training loop clears with set_to_none=True, in lockstep", ("zero_grad", "skew", *FEATURE_DIMS),
       lambda a: (a["zero_grad"] == "optimizer" and a["skew"] == "none") or _plain_loop(a)),
    _c("accumulation-without-join", "the production-training oracle models several micro-batches per step without "
       "join() only (a joined rank's shadow collectives inside no_sync() are not modelled)",
       ("accumulation", "join"), lambda a: a["accumulation"] == "1" or a["join"] == "off"),
    _c("sparse-one-micro-batch", "sparse gradients accumulated under no_sync() are not modelled by the oracle",
       ("accumulation", "model"), lambda a: a["accumulation"] == "1" or not _trait(a, "sparse")),
    _c("join-buffer-free", "join() moves the buffer source; the oracle models join() for buffer-free models",
       ("join", "model"), lambda a: a["join"] == "off" or not _trait(a, "buffers")),
    _c("split-plain", "forwards inside no_sync() with backwards outside are a plain-loop switch",
       ("accumulation", *FEATURE_DIMS), lambda a: a["accumulation"] != "split" or _plain_loop(a)),
    _c("sparse-dense-only-features", "sparse gradients: compression, reduce_dtype, bucket views, clipping and "
       "compile are defined for dense gradients", ("model", "hook", "reduce_dtype", "bucket_view", "clip", "compile",
                                                   "precision"),
       lambda a: not _trait(a, "sparse") or (a["hook"] in ("none", "allreduce") and a["reduce_dtype"] == "none"
                                             and not a["bucket_view"] and a["clip"] == "off"
                                             and a["compile"] == "off" and a["precision"] in ("fp32", "fp64"))),
    _c("compile-eager-features", "torch.compile is judged by a band (aot_eager reorders reductions); it is not "
       "composed with other rules that need bitwise shares", ("compile", "hook", "reduce_dtype", "precision",
                                                               "activation_ckpt", "join", "round_trip"),
       lambda a: a["compile"] == "off" or (a["hook"] == "none" and a["reduce_dtype"] == "none"
                                           and a["precision"] in ("fp32", "fp64") and a["activation_ckpt"] == "off"
                                           and a["join"] == "off" and a["round_trip"] == "off")),
    _c("buffers-fp32", "the models' buffers stay fp32 (build_model casts parameters only): their forward needs "
       "fp32 parameters (or autocast)", ("model", "precision"),
       lambda a: not _trait(a, "buffers") or a["precision"] in ("fp32", *AMP)),
    _c("sparse-sgd", "torch's Adam family and weight decay refuse sparse gradients", ("model", "optimizer"),
       lambda a: not _trait(a, "sparse") or a["optimizer"] in ("sgd", "none")),
    _c("mixed-dtype-fp32", "the mixed-dtype model's fp32 layers meet its own fp64 layer: another parameter dtype "
       "or autocast changes what is mixed (the inputs no longer fit a layer)", ("model", "precision"),
       lambda a: not _trait(a, "fp64-layer") or a["precision"] == "fp32"),
    _c("reentrant-hides-parameters", "reentrant checkpointing hides a segment's parameters from find_unused_parameters' "
       "graph walk (a clear error: the pinned ckpt-reentrant-* scenarios)", ("activation_ckpt", "find_unused"),
       lambda a: a["activation_ckpt"] != "reentrant" or not a["find_unused"]),
    _c("lossy-reduce-one-step", "a lossy reduction (fp16/bf16 hook, reduce_dtype) is judged on one step, re-anchored: "
       "straight through, its rounding compounds with no bound derived, so features that need several steps "
       "(a round trip, an alternating zero_grad, join) are not composed with it",
       ("hook", "reduce_dtype", "round_trip", "zero_grad", "join"),
       lambda a: (a["hook"] in ("none", "allreduce") and a["reduce_dtype"] == "none")
       or (a["round_trip"] == "off" and a["zero_grad"] == "optimizer" and a["join"] == "off")),
    _c("join-dense", "join() with sparse gradients: refimpl refuses it with a clear error, torch DDP aborts (its "
       "shadow all-reduce is dense); not a combination either engine offers", ("join", "model"),
       lambda a: a["join"] == "off" or not _trait(a, "sparse")),
    _c("join-no-round-trip", "the rank loop's round trip runs at a step a joined rank never reaches (its save and "
       "rebuild are collectives): join() and a round trip are not composed", ("join", "round_trip"),
       lambda a: a["join"] == "off" or a["round_trip"] == "off"),
    _c("lossy-reduce-sgd", "a lossy reduction's gradient is judged within its derived bound; Adam normalizes each "
       "element by its own history, so the parameters it steps to from such a gradient have no derived bound",
       ("hook", "reduce_dtype", "optimizer"),
       lambda a: (a["hook"] in ("none", "allreduce") and a["reduce_dtype"] == "none")
       or a["optimizer"] in ("sgd", "sgd-wd", "none")),
    _c("no-optimizer-plain-loop", "without an optimizer gradients accumulate across steps: the plain rank loop's "
       "scenario (the production-training loop and its oracle step and clear every step)",
       ("optimizer", *FEATURE_DIMS), lambda a: a["optimizer"] != "none" or _plain_loop(a)),
    _c("no-optimizer-exact-sums", "gradients accumulated across steps without an optimizer are modelled for "
       "exact fp32/fp64 sums (1-2 ranks, no low-precision parameters or lossy reductions): the oracle adds plain "
       "tensors, not summation-order envelopes", ("optimizer", "precision", "hook", "reduce_dtype", "world"),
       lambda a: a["optimizer"] != "none" or (a["precision"] in ("fp32", "fp64") and a["hook"] in ("none", "allreduce")
                                              and a["reduce_dtype"] == "none" and a["world"] <= 2)),
    _c("adam-two-ranks", "Adam normalizes each element by its own history: at 3+ ranks a summation-order difference "
       "becomes a full-size step, and the straight-through band does not hold", ("optimizer", "world"),
       lambda a: a["world"] <= 2 or a["optimizer"] in ("sgd", "sgd-wd", "none")),
    _c("compile-unit-scale", "torch.compile's band (no bound derived) has an absolute part sized for O(1) values: "
       "large and tiny data are not judged under it", ("compile", "data"),
       lambda a: a["compile"] == "off" or a["data"] in ("int", "cont")),
    _c("fp16-reduction-unscaled", "an fp16 reduction (the fp16 hook, reduce_dtype=fp16) of GradScaler-scaled "
       "gradients: where the scaled values leave fp16's range the cast gives inf and the scaler skips the step; the "
       "oracle bounds a finite reduction (a relative bound) and does not simulate the overflow",
       ("hook", "reduce_dtype", "precision"),
       lambda a: a["precision"] != "amp-fp16" or (a["hook"] != "fp16" and a["reduce_dtype"] != "fp16")),
    _c("half-params-two-ranks", "bf16/fp16 parameters at 3-4 ranks: the straight-through check's band (no bound "
       "derived) does not hold once rounding compounds over steps", ("precision", "world"),
       lambda a: a["precision"] not in HALF or a["world"] <= 2),
    _c("scaled-data-two-ranks", "large and tiny data at 3+ ranks: the straight-through band (no bound derived) does "
       "not hold once summation-order differences compound over steps", ("data", "world"),
       lambda a: a["data"] in ("int", "cont") or a["world"] <= 2),
    _c("join-two-ranks", "join() runs up to five steps; at 3+ ranks its straight-through band (no bound derived) does "
       "not hold once summation-order differences compound over them (every re-anchored step within its rule; the "
       "pinned join-*/mlp/w3-w4 scenarios keep 3-4 ranks)", ("join", "world"),
       lambda a: a["join"] == "off" or a["world"] <= 2),
    _c("compile-two-ranks", "torch.compile's band at 3+ ranks with no_sync accumulation fails its straight-through "
       "check on a correct engine (the hand-written compile scenarios at 3 ranks are in full only too)",
       ("compile", "world"), lambda a: a["compile"] == "off" or a["world"] <= 2),
    _c("half-params-adam", "Adam's eps (1e-8) is 0 in fp16/bf16 parameters: a zero gradient divides by zero on "
       "every engine", ("precision", "optimizer"),
       lambda a: a["precision"] not in HALF or a["optimizer"] in ("sgd", "sgd-wd", "none")),
    _c("zero-gradient-adam", "a parameter whose true gradient is 0 (attention's key bias, a bias before "
       "BatchNorm) gets rounding noise at 3+ ranks, which Adam turns into full steps: not a meaningful check",
       ("model", "optimizer", "world"),
       lambda a: not _trait(a, "zero-gradient") or a["world"] <= 2 or a["optimizer"] in ("sgd", "sgd-wd", "none")),
    # -- the orders (meaning)
    _c("build-order-needs-optimizer", "without an optimizer there is nothing to build before or after wrapping",
       ("build_order", "optimizer"), lambda a: a["build_order"] == "wrap-first" or a["optimizer"] != "none"),
    _c("resume-order-needs-round-trip", "a resume order says where a checkpoint round trip loads; without a round "
       "trip nothing is loaded", ("resume_order", "round_trip"),
       lambda a: a["resume_order"] == "wrap-load" or a["round_trip"] != "off"),
    # -- not modelled yet
    _c("muon-two-ranks-full-precision", "Muon orthogonalizes each update in bf16 (Newton-Schulz): at 3+ ranks a "
       "summation-order difference in a gradient's last bit becomes another update and the straight-through band "
       "does not hold; its AdamW part's eps is 0 in fp16/bf16 parameters; it refuses sparse gradients",
       ("optimizer", "world", "precision", "model"),
       lambda a: a["optimizer"] != "muon" or (a["world"] <= 2 and a["precision"] not in HALF
                                              and not _trait(a, "sparse"))),
    _c("sparse-two-ranks", "sparse gradients at 3+ ranks over three steps or more (a round trip, or the plain loop "
       "with options): refimpl and torch DDP alike leave the oracle's summation-order envelope by 1 ulp at the third "
       "step (how the sparse all-reduce coalesces rows is not modelled; the pinned sparse/embedding/w3 stays)",
       ("model", "world"), lambda a: not _trait(a, "sparse") or a["world"] <= 2),
    _c("checkpointing-two-ranks", "activation checkpointing runs in the production loop, judged straight through by "
       "its band (no bound derived: the accumulated envelope is not composed with the production features); at 3+ ranks "
       "rounding compounds past it on a correct engine (refimpl-ddp, ckpt-mlp/w3 with reentrant checkpointing: 157 ulps "
       "in fp64, 559 in fp32 at step 2, every re-anchored step within its rule)", ("activation_ckpt", "world"),
       lambda a: a["activation_ckpt"] == "off" or a["world"] <= 2),
    _c("muon-no-round-trip", "Muon with a checkpoint round trip: refimpl-ddp (a correct engine) steps 1 ulp off the "
       "re-anchored oracle's AdamW half after the resume (unused/w1/fp64, head.bias, step 1); how the Muon+AdamW pair "
       "reloads its state is not modelled yet", ("optimizer", "round_trip"),
       lambda a: a["optimizer"] != "muon" or a["round_trip"] == "off"),
)
