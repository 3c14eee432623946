"""The sharded area's scenario space: its dimensions, their values, and the constraints between them.

Plain data, as the DDP area's (`conformance.space.ddp`): `conformance.space.sharded_rows` turns a
row into a `Scenario`, `conformance.space.profiles` generates the profiles. The first value of
each dimension is its default (what a hand-written scenario that does not mention it has).
Values the suite cannot run yet are not listed; `LEFT_OUT` says which and why.

Engine dimensions (`ENGINE_DIMS`: mesh, units, reshard, placement, offload, and the
mixed-precision policy among the precisions) are the options only some engines offer (refimpl's
ZeRO-2 none of them, refimpl ZeRO-3 all but offload, FSDP2 all). A pairwise array puts a pair of
the other dimensions into some row, but that row may need an option an engine lacks, so the
engine would skip the pair. `TIERS` name the subspaces engines run (every sharded engine:
`PORTABLE`, the engine dimensions at their defaults, parameter dtypes only; refimpl ZeRO-3: all
but a state dict of a dim-1 placement): `standard` covers each tier's pairs in rows of
their own too (`conformance.space.profiles`), so ZeRO-2 meets fp16 parameters with large data.

Constraints, named with their reason, of the two kinds the DDP space has: *meaning* (an HSDP
mesh needs an even world size) and *not modelled* (the oracle cannot compose the two rules yet:
the pair is excluded, never judged by a band).
"""

from __future__ import annotations

from conformance.space.covering import Constraint, Dimension

# model value -> (zoo model, model kwargs, traits).
MODELS: dict[str, tuple[str, dict, frozenset[str]]] = {
    "mlp": ("mlp", {}, frozenset()),
    # parameters the world size does not divide (17 and 3 rows, 17 columns): padded shards
    "uneven": ("mlp", {"width": 17, "d_out": 3}, frozenset({"uneven"})),
    "tied": ("tied", {}, frozenset({"tied"})),
    "transformer": ("transformer", {}, frozenset({"zero-gradient", "normalized"})),
}

# data=large: the inputs' power-of-two factor that brings each model's largest gradient near
# 2**14 with fp16's forward still finite (so an fp16 sum of W undivided shares overflows where
# dividing first does not); the transformer normalizes its inputs (no large regime).
LARGE_SCALE = {"mlp": 7, "uneven": 6, "tied": 3}
TINY_SCALE = -10

HALF = ("bf16", "fp16")
MP = ("mp-fp32", "mp-bf16")  # param_dtype=bf16 with reduce_dtype fp32 / bf16

DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("model", tuple(MODELS), "tied, parameters W does not divide (uneven shards)"),
    Dimension("world", (2, 4, 3), "world size (8 in full)"),
    Dimension("mesh", ("flat", "hsdp"), "1-D mesh, or HSDP's (2, W/2) replicate x shard mesh"),
    Dimension("units", ("root", "children"), "one unit, or a unit per block (nested fully_shard)"),
    Dimension("reshard", ("on", "off", "to-2"), "reshard_after_forward: True / False / 2 (groups of 2)"),
    Dimension("precision", ("fp32", "fp64", "bf16", "fp16", *MP),
              "parameter dtype, or a mixed-precision policy (bf16 compute, reduce fp32 / bf16)"),
    Dimension("placement", ("dim0", "dim1"), "shard_placement_fn: dim 0, or dim 1 where W divides it"),
    Dimension("offload", ("off",), "CPU offload of shards, gradients and the step (on: full only)"),
    Dimension("data", ("int", "cont", "large", "tiny"),
              "small-integer weights / continuous weights / inputs x2**k near fp16's range / inputs x2**-10"),
    Dimension("accumulation", ("1", "2", "rs-2"),
              "micro-batches per step (the first under no_sync); rs-2: HSDP's reduce-scatter-only accumulation"),
    Dimension("clip", ("off", "below", "above"), "clip_grad_norm_ far below / far above the gradient norm"),
    Dimension("state_dict", ("off", "full", "sharded", "sharded-twice"),
              "state-dict round trip (save, rebuild, load) after step 2; twice: after steps 2 and 4"),
    Dimension("optimizer", ("sgd", "adam"), "sgd: momentum 0.5"),
    Dimension("shards", ("even", "uneven"), "per-rank batch sizes"),
)

ENGINE_DIMS = ("mesh", "units", "reshard", "placement", "offload")
# Every sharded engine runs these values: the engine dimensions at their defaults, parameter dtypes.
PORTABLE = {**{d: None for d in ENGINE_DIMS}, "precision": ("fp32", "fp64", "bf16", "fp16"), "accumulation": ("1", "2")}
# refimpl ZeRO-3 runs every value but refuses a state dict (model + optimizer) of a parameter placed
# on dim 1 (refimpl/sharded/checkpoint.py keeps the flat-chunk layout; its adapter's `unavailable` says so).
FLAT_CHUNK_STATE = Constraint("zero3-flat-chunk-state", "refimpl ZeRO-3's state dicts refuse a parameter placed on "
                              "dim 1", ("placement", "state_dict"),
                              lambda a: a["placement"] == "dim0" or a["state_dict"] == "off")
# The tiers `standard` covers pair by pair in rows of their own (conformance.space.profiles).
TIERS = (("refimpl-zero3", {}, (FLAT_CHUNK_STATE,)), ("every sharded engine", PORTABLE, ()))

# full adds world size 8 (8 gloo ranks on a CPU host are slow; standard stops at 4) and CPU
# offload: on a CPU-only host its shards and step stay on the CPU they came from (the code path,
# not the copies), and only FSDP2 offers it here, so in standard it would take rows refimpl skips.
FULL_VALUES = {"world": (2, 4, 3, 8), "offload": ("off", "on")}

LEFT_OUT = {
    "model=unused (a parameter unused on a rank)": "FSDP2 aborts on it (ranks reduce-scatter different sets: its known "
    "ends-world xfail, a pool respawn per row), and refimpl's ZeRO-2/ZeRO-3 state dicts cannot round-trip a parameter "
    "that never had optimizer state (the fresh engine's template has it: KeyError / DCP 'Missing key', found by this "
    "space's first runs); the pinned unused-on-rank1 scenarios keep the value",
    "world=1": "one rank shards nothing (the pinned sharded/plain/mlp/w1 keeps it)",
    "models with buffers (cnn-bn, buffered, resnet)": "FSDP1/FSDP2 never broadcast buffers after construction; "
    "the mixed-precision oracle casts parameters only; the pinned buffer scenarios keep them",
    "realistic models (gpt, llama, moe)": "seconds per case on 2 cores; the pinned realistic scenarios keep them",
    "reshard=to-4": "needs 8 ranks (full's hand-written nested-reshard-to-4)",
    "mp with param_dtype=fp16": "no engine here is asked for an fp16 compute policy yet (bf16 is FSDP2's documented one)",
    "optimizer=none / adamw / fused": "accumulation without an optimizer is pinned (accumulate-no-zero-grad); the "
    "Adam family's variants are the DDP space's dimension (the sharded engines step torch's optimizers alike)",
    "state-dict load order": "the runner rebuilds in one order (model, engine, optimizer, load); another order "
    "needs an order switch in conformance.runners.sharded_checkpoint",
    "offload=on in standard": "refimpl has no offload and FSDP1's CPUOffload pins memory (refused without an "
    "accelerator): FSDP2 alone would run its pairs, in rows the others skip; full has them (the pinned cpu-offload "
    "scenarios stay in quick and standard)",
}


def _c(name: str, reason: str, reads: tuple[str, ...], allows) -> Constraint:
    return Constraint(name, reason, reads, allows)


def _trait(a, trait: str) -> bool:
    return trait in MODELS[a["model"]][2]


def _features(a) -> bool:
    """Whether a row runs in the production-training loop (clipping, a state-dict round trip)."""
    return a["clip"] != "off" or a["state_dict"] != "off"


CONSTRAINTS: tuple[Constraint, ...] = (
    # -- meaning
    _c("hsdp-even-world", "an HSDP mesh of 2 replicas needs an even world size (2x1 at w2, 2x2 at w4)",
       ("mesh", "world"), lambda a: a["mesh"] == "flat" or a["world"] % 2 == 0),
    _c("rs-accumulation-hsdp", "reduce-scatter-only accumulation (set_requires_all_reduce(False)) is HSDP's",
       ("accumulation", "mesh"), lambda a: a["accumulation"] != "rs-2" or a["mesh"] == "hsdp"),
    _c("reshard-int-nested-flat", "reshard_after_forward=2 reshards a unit to groups of 2 ranks: a divisor of W "
       "strictly between 1 and W on a 1-D mesh, per block", ("reshard", "units", "world", "mesh"),
       lambda a: a["reshard"] != "to-2" or (a["units"] == "children" and a["world"] == 4 and a["mesh"] == "flat")),
    _c("normalized-inputs-unscaled", "LayerNorm normalizes the inputs' scale away: no large regime",
       ("model", "data"), lambda a: a["data"] != "large" or a["model"] in LARGE_SCALE),
    # -- not modelled yet (the oracle cannot compose these; excluded, never judged by a band)
    _c("clip-bound-sgd", "the bound for a clip coefficient from a reordered global norm is derived for SGD "
       "(conformance.oracle.clip_bound); Adam's step from it has none", ("clip", "optimizer"),
       lambda a: a["clip"] == "off" or a["optimizer"] == "sgd"),
    _c("rs-accumulation-plain-loop", "HSDP's reduce-scatter tree is modelled by the plain loop's oracle "
       "(conformance.oracle.baseline), not the production-training one", ("accumulation", "clip", "state_dict"),
       lambda a: a["accumulation"] != "rs-2" or not _features(a)),
    _c("fp16-subnormals", "tiny values in fp16 fall into subnormals, where the relative bound does not hold",
       ("data", "precision"), lambda a: a["data"] != "tiny" or a["precision"] != "fp16"),
    _c("half-params-sgd", "Adam's eps (1e-8) is 0 in fp16/bf16 parameters: a zero gradient divides by zero on "
       "every engine", ("precision", "optimizer"), lambda a: a["precision"] not in HALF or a["optimizer"] == "sgd"),
    _c("half-params-plain-loop", "bf16/fp16 parameters' derived bound is composed with the plain loop's oracle "
       "(clipping's bound assumes the step's own dtype rounds like fp32)", ("precision", "clip", "state_dict"),
       lambda a: a["precision"] not in HALF or not _features(a)),
    _c("adam-two-ranks", "Adam normalizes each element by its own history: at 3+ ranks a summation-order "
       "difference becomes a full-size step, and the straight-through band does not hold", ("optimizer", "world"),
       lambda a: a["world"] <= 2 or a["optimizer"] == "sgd"),
    _c("tied-accumulation", "a rank adds a tied parameter's uses over micro-batches in an order of its own (FSDP2: "
       "each use into its unsharded accumulator; the oracle: autograd's sum per micro-batch first): 1 ulp apart "
       "wherever the sums round, not a bug; the order is not modelled", ("model", "accumulation"),
       lambda a: not _trait(a, "tied") or a["accumulation"] == "1"),
    _c("bf16-reduce-one-step", "a bf16 reduce at 3+ ranks is judged on one step within its derived bound, "
       "re-anchored; straight through, its rounding compounds (no bound derived), so the features that need more "
       "steps (clipping, a round trip) are not composed with it",
       ("precision", "world", "clip", "state_dict"),
       lambda a: a["precision"] != "mp-bf16" or a["world"] <= 2 or not _features(a)),
    _c("features-two-ranks", "the transformer (LayerNorm and softmax) and the tied weight (a sum of two uses in an "
       "order the engine picks) round their sums: at 3+ ranks, over the 3-5 steps of clipping or a round trip, "
       "summation-order differences compound past the straight-through band (no bound derived; the re-anchored "
       "steps pass)", ("model", "world", "clip", "state_dict"),
       lambda a: a["model"] not in ("transformer", "tied") or a["world"] <= 2 or not _features(a)),
    _c("scaled-data-features", "large and tiny data over the 3-5 steps of clipping or a round trip: the "
       "straight-through band's absolute part is sized for O(1) values (no bound derived; the re-anchored steps pass)",
       ("data", "clip", "state_dict"), lambda a: a["data"] in ("int", "cont") or not _features(a)),
    _c("scaled-data-two-ranks", "large and tiny data at 3+ ranks: the straight-through band (no bound derived) "
       "does not hold once summation-order differences compound over steps", ("data", "world", "precision"),
       lambda a: a["data"] in ("int", "cont") or a["world"] <= 2 or a["precision"] in HALF),
)
