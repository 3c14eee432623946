"""The `data_parallel` area's scenario space: its dimensions, their values, the constraints between them.

Plain data, as the DDP area's (`conformance.space.ddp`): `conformance.space.data_parallel_rows`
turns a row into a `Scenario`, `conformance.space.profiles` generates the profiles. The first
value of each dimension is its default (what a hand-written scenario that does not mention it
has). Every dimension is one the runner (`conformance.runners.data_parallel`) already drives and
the replica oracle already judges: the model (which also fixes the input and output structure,
the batch dimension, keyword arguments, buffers, frozen and tied parameters), the replica count,
how the batch splits over it, the dtype, the data regime, the optimizer between calls, the
grad-mode calls, input gradients, autocast and a mode switch. Values the suite cannot run yet are
not listed; `LEFT_OUT` says which and why.

Constraints, named with their reason, of the two kinds the DDP space has: *meaning* (a batch
cannot split unevenly over one replica) and *not modelled* (the oracle cannot compose the two
rules yet: the pair is excluded, never judged by a band).
"""

from __future__ import annotations

from conformance.space.covering import Constraint, Dimension

# model value -> traits (the model names are `conformance.models.data_parallel.DP_MODELS`' keys).
MODELS: dict[str, frozenset[str]] = {
    "mlp": frozenset(),
    "dict-in": frozenset({"nested-in"}),
    "tuple-in": frozenset({"nested-in", "nested-out", "reused"}),
    "multi-arg": frozenset({"nested-in", "nested-out", "reused"}),
    "nested-io": frozenset({"nested-in", "nested-out"}),
    "batch-dim1": frozenset({"dim"}),
    "batch-last": frozenset({"dim"}),
    "kwargs-in": frozenset({"kwargs"}),
    "kwargs-dim1": frozenset({"kwargs", "dim"}),
    "scalar-out": frozenset({"per-chunk"}),
    "cnn-bn-eval": frozenset({"buffers", "rounds"}),
    "cnn-bn-train": frozenset({"buffers", "per-chunk", "rounds"}),
    "frozen": frozenset(),
    "tied": frozenset({"reused", "rounds"}),
    "embedding": frozenset({"index-input"}),
    "transformer": frozenset({"rounds"}),
}

DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("model", tuple(MODELS), "input/output structure, batch dim, kwargs, buffers, frozen/tied parameters"),
    Dimension("replicas", (2, 1, 3, 4), "devices (replicas) the batch is scattered over"),
    Dimension("batch", ("even", "uneven", "fewer", "one-row"),
              "4 rows per replica / 2R+1 rows / R-1 rows (fewer rows than replicas) / a single row"),
    Dimension("dtype", ("fp32", "fp64"), "the module's and inputs' dtype"),
    Dimension("data", ("int", "cont"), "small-integer weights and inputs (exact sums) / continuous ones"),
    Dimension("optimizer", ("none", "sgd", "adam"),
              "none: two calls accumulate into .grad; sgd (momentum 0.5) / adam: a step between three calls"),
    Dimension("grad_mode", ("on", "no-grad-last", "no-grad-first"),
              "an extra call under torch.no_grad() after the training calls / before them"),
    Dimension("input_grad", (False, True), "floating-point inputs require grad (scatter passes it back)"),
    Dimension("autocast", ("off", "bf16"), "every call under torch.autocast(bfloat16): the replicas' threads see it"),
    Dimension("mode_switch", ("off", "eval-last"), "module.eval() before the last call"),
)

# full adds the two models the hand-written catalogue keeps in full only (their sums are like mlp's).
FULL_VALUES = {"model": (*MODELS, "many-tiny", "mixed-dtype")}

LEFT_OUT = {
    "dtype=fp16/bf16": "half-precision modules need CUDA (torch.nn.DataParallel is CUDA-only, and the contract's "
                       "D12 checks them in GPU CI); on a CPU the generated space stays fp32/fp64",
    "output_device other than the first device, replicas on several GPUs": "the contract does not check them "
                                                                             "(CPU only in this project's CI)",
    "a batch of 0 rows": "the contract's D4 checklist gap: neither reference defines the gathered output of no rows",
    "inference mode": "torch's parallel_apply does not re-enter it (D15: not checked)",
}


def _c(name: str, reason: str, reads: tuple[str, ...], allows) -> Constraint:
    return Constraint(name, reason, reads, allows)


def trait(a, name: str) -> bool:
    return name in MODELS.get(a["model"], ())


CONSTRAINTS: tuple[Constraint, ...] = (
    # -- meaning
    _c("uneven-needs-replicas", "one replica takes the whole batch: no split is uneven", ("batch", "replicas"),
       lambda a: a["batch"] != "uneven" or a["replicas"] >= 2),
    _c("fewer-needs-three", "fewer rows than replicas, more than one row, needs 3+ replicas (at 2 it is one-row)",
       ("batch", "replicas"), lambda a: a["batch"] != "fewer" or a["replicas"] >= 3),
    _c("index-inputs-no-grad", "the embedding's inputs are indices: they cannot require grad",
       ("model", "input_grad"), lambda a: not (trait(a, "index-input") and a["input_grad"])),
    _c("autocast-fp32", "CPU autocast casts fp32 operations only: an fp64 module runs unchanged under it",
       ("autocast", "dtype"), lambda a: a["autocast"] == "off" or a["dtype"] == "fp32"),
    _c("scalars-two-replicas", "0-dim outputs of one replica: torch returns the 0-dim tensor, refimpl too, and the "
       "per-chunk oracle a 1-vector; the contract leaves it unchecked (D14: the references disagree)",
       ("model", "replicas"), lambda a: a["model"] != "scalar-out" or a["replicas"] >= 2),
    _c("buffers-fp32", "the built-in models' buffers stay fp32 (build_model casts parameters only): BatchNorm's "
       "forward needs fp32 parameters", ("model", "dtype"), lambda a: not trait(a, "buffers") or a["dtype"] == "fp32"),
    # -- not modelled yet (the oracle cannot compose these; excluded, never judged by a band)
    _c("per-chunk-even", "0-dim outputs and train-mode BatchNorm are judged against the module on each equal chunk "
       "(conformance.oracle.data_parallel, contract D9/D14: batches that split evenly); an uneven split changes "
       "how many replicas run and what replica 0's statistics are", ("model", "batch"),
       lambda a: not trait(a, "per-chunk") or a["batch"] == "even"),
    _c("autocast-one-call-band", "autocast's straight-through band counts one forward's bf16 roundings; over "
       "optimizer steps they compound with no bound derived", ("autocast", "optimizer"),
       lambda a: a["autocast"] == "off" or a["optimizer"] == "none"),
    _c("autocast-reused-weight-cast", "autocast caches one bf16 cast of a leaf parameter, so the oracle's replay sums "
       "the uses of a weight used twice (tied, tuple-in's and multi-arg's shared layers) in bf16, while a replica's "
       "parameters are not leaves (replicate's copies): each use is cast on its own and the uses sum in fp32; which "
       "one a replica does is not modelled", ("model", "autocast"),
       lambda a: not trait(a, "reused") or a["autocast"] == "off"),
    _c("autocast-band-linear", "autocast's straight-through band counts the bf16 roundings of a chain of linear maps; "
       "the transformer's softmax and LayerNorm amplify them (no bound derived; the replayed replicas pass)",
       ("model", "autocast"), lambda a: a["model"] != "transformer" or a["autocast"] == "off"),
    _c("adam-two-replicas", "Adam's first step is +-lr for any nonzero gradient: where values round (3+ replicas; "
       "softmax, normalization, tied products past fp32's integers) an element whose gradient is exactly zero comes "
       "out as rounding noise in one split and not in the other, a full-size step apart, past the straight-through "
       "band (no bound derived; the re-anchored replicas pass)", ("optimizer", "replicas", "model"),
       lambda a: a["optimizer"] != "adam" or (a["replicas"] <= 2 and not trait(a, "rounds"))),
    _c("tied-no-steps", "the tied model's five integer layers reach 1e8 and its SGD steps 1e17: the straight-through "
       "band (rows x u, no bound derived) does not compound that far (the re-anchored replicas pass)",
       ("model", "optimizer"), lambda a: a["model"] != "tied" or a["optimizer"] == "none"),
    _c("transformer-plain", "the transformer's straight-through band (rows x u, no bound derived) is calibrated on "
       "fp32 calls without steps; its softmax and LayerNorm leave it between splits over SGD steps (15-280 ulps) "
       "and in fp64 (75-330 ulps); the replayed replicas pass", ("model", "dtype", "optimizer"),
       lambda a: a["model"] != "transformer" or (a["dtype"] == "fp32" and a["optimizer"] == "none")),
    _c("mixed-dtype-plain", "the mixed-dtype model's fp64 layer meets its fp32 ones: an fp64 module breaks the mix "
       "(mat1 and mat2 dtypes), and after an SGD step a ReLU input that is exactly zero in exact arithmetic takes "
       "the other branch in one split (a whole integer apart straight through)", ("model", "dtype", "optimizer"),
       lambda a: a["model"] != "mixed-dtype" or (a["dtype"] == "fp32" and a["optimizer"] == "none")),
)
