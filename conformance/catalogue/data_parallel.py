"""The `data_parallel` scenario catalogue (single-process data parallelism, issue 5).

`world_size` is the number of replicas; the full batch has `sum(shard_sizes)` rows (the
split itself is the implementation's: refimpl splits 5 rows over 4 replicas 2,1,1,1, torch
2,2,1). The oracle is one plain forward/backward of the same module on the full batch.

Tolerance policy: the oracle replays every replica on the implementation's own split
(`conformance.oracle.replica_oracle`), so each replica's gradient, the gathered output and the inputs'
gradients are bitwise what a correct implementation holds; only the sum over replicas may
round differently. With integer weights and inputs and models made of linear maps,
convolutions, ReLU and sums, every value is a small integer (or a dyadic multiple from the loss
weights), every sum is exact whatever its order, and the scenario is bitwise at any replica
count. Models with softmax, LayerNorm or BatchNorm, an optimizer step (weights leave the
integers) or autocast produce rounded values: bitwise at 1-2 replicas (one order), bitwise to a
summation order at 3-4 (`replica_rule`). Their old band (a tolerance scaled by the rows summed)
stays as the straight-through check's: the full-batch module trained from the seeds.
"""

from __future__ import annotations

from dataclasses import replace

from conformance.catalogue.profiles import FULL, QUICK, STANDARD
from conformance.catalogue.profiles import SHORT_DTYPE as SHORT
from conformance.spec import Capability as C
from conformance.spec import Scenario, Tolerance, float_tolerance, summation_order

# Values outside fp32's exact-integer range (tied: five integer layers reach 1e8) or non-dyadic.
EXACT_SUMS = Tolerance(True, reason="exact: small-integer data, so sums over replicas and rows are exact in any order")
INEXACT_MODELS = {"transformer", "cnn-bn-eval", "cnn-bn-train", "tied"}
# Clauses of docs/contracts/data_parallel.md. Every scenario checks outputs and parameter
# gradients; the others are named by the scenarios that exercise them (or derived in `make`).
CORE = ("D1", "D2")
ACCUMULATE, SPLIT, IN_NESTED, OUT_NESTED, DIM, INPUT_GRAD = "D3", "D4", "D5", "D6", "D7", "D8"
BUFFERS, MODE, GRAD_MODE, DTYPES, FROZEN_TIED, SCALARS = "D9", "D10", "D11", "D12", "D13", "D14"
THREAD_STATE, MODULE_KWARGS = "D15", "D16"  # issue 30
MODEL_CLAUSES = {
    "dict-in": (IN_NESTED,), "tuple-in": (IN_NESTED, OUT_NESTED), "multi-arg": (IN_NESTED, OUT_NESTED),
    "nested-io": (IN_NESTED, OUT_NESTED), "batch-dim1": (DIM,), "batch-last": (DIM,),
    "cnn-bn-eval": (BUFFERS, MODE), "cnn-bn-train": (BUFFERS, MODE), "frozen": (FROZEN_TIED,),
    "tied": (FROZEN_TIED,), "mixed-dtype": (DTYPES,), "scalar-out": (SCALARS,),
    "kwargs-in": (MODULE_KWARGS, IN_NESTED), "kwargs-dim1": (MODULE_KWARGS, DIM),
}


def replica_rule(dtype: str, replicas: int, straight_through: Tolerance) -> Tolerance:
    """Inexact values, judged replica by replica (`conformance.oracle.replica_oracle`): each replica's
    gradient is replayed on the implementation's split, so only the sum over replicas can round
    differently: bitwise at 1-2 replicas (one order), bitwise to a summation order at 3-4. The old
    band stays as the full-batch, straight-through check's."""
    if replicas <= 2:
        return Tolerance(True, reason=f"{dtype}: replicas replayed on the implementation's split; a sum of at most "
                                      "two replicas is order-free", straight_through=straight_through)
    return replace(summation_order(dtype, replicas, f"{dtype}: the sum of {replicas} replicas' gradients in an "
                                                    "order the implementation picks"),
                   straight_through=straight_through)


# Under autocast each replica's matmuls round their partial sums to bfloat16, replayed bitwise
# by the oracle under the same autocast; the parameters' gradients are fp32 and summed in fp32.
# The full-batch (straight-through) check keeps the old band: it rounds once where the replicas
# round per chunk, at most 4 roundings (rtol 4u = 2^-6, u = 2^-8); atol covers a gradient whose
# rounded partials cancel (integer data: partials below 2^4, each off by at most 2^4 * u).
AUTOCAST_BAND = Tolerance(False, rtol=2.0 ** -6, atol=2.0 ** -4, reason="bfloat16 autocast: per-replica partial "
                          "sums rounded to bfloat16 (u = 2^-8), 4 roundings")


def autocast_rule(replicas: int) -> Tolerance:
    """fp32 modules under bfloat16 autocast, replayed replica by replica under the same autocast."""
    return replica_rule("float32", replicas, AUTOCAST_BAND)


def make(name: str, model: str, *, w: int = 2, batch: int | None = None, shards: tuple[int, ...] | None = None,
         profiles: frozenset = QUICK, dtype: str = "float32", steps: int = 2, clauses: tuple[str, ...] = (),
         **fields) -> Scenario:
    if shards is None:
        batch = batch if batch is not None else 4 * w
        base, extra = divmod(batch, w)
        shards = tuple(base + (1 if r < extra else 0) for r in range(w))
    rows = sum(shards)
    optimizer = fields.pop("optimizer", "none")
    exact = model not in INEXACT_MODELS and dtype in ("float32", "float64") and optimizer == "none"
    if exact:
        tolerance = EXACT_SUMS
    else:
        tolerance = replica_rule(dtype, w, float_tolerance(dtype, rows, f"{dtype}: batch sums over {rows} rows in "
                                                                         "another split, compounding over steps"))
    requires = {C.HALF_PRECISION} if dtype in ("float16", "bfloat16") else set()
    switches = fields.pop("switches", {})
    derived = set(CORE) | set(clauses) | set(MODEL_CLAUSES.get(model, ()))
    if optimizer == "none" and steps > 1:
        derived.add(ACCUMULATE)
    if dtype != "float32":
        derived.add(DTYPES)
    if any(s != shards[0] for s in shards) or rows < w:
        derived.add(SPLIT)
    derived |= {INPUT_GRAD} if switches.get("input_grad") else set()
    derived |= {GRAD_MODE} if switches.get("no_grad") or switches.get("no_grad_first") else set()
    derived |= {THREAD_STATE} if switches.get("autocast") or switches.get("no_grad_first") else set()
    derived |= {MODE} if switches.get("eval_last") else set()
    return Scenario(
        id=f"data_parallel/{name}/{model}/r{w}/{SHORT[dtype]}",
        area="data_parallel",
        model=model,
        dtype=dtype,
        world_size=w,
        shard_sizes=shards,
        steps=steps,
        optimizer=optimizer,
        tolerance=fields.pop("tolerance", tolerance),
        exact_data=fields.pop("exact_data", exact or dtype in ("float16", "bfloat16")),
        requires=frozenset(requires),
        buffer_rule="unchanged",
        profiles=profiles,
        model_kwargs=tuple(sorted(switches.items())),
        clauses=tuple(sorted(derived, key=lambda c: int(c[1:]))),
        **fields,
    )


def scenarios() -> list[Scenario]:
    """The hand-written scenarios (pinned) and the covering arrays generated from the area's space
    around them (`conformance.space.data_parallel`, issue 38)."""
    from conformance.space.profiles import generated

    pinned = handwritten()
    return pinned + generated("data_parallel", pinned)


def full_generated() -> list[Scenario]:
    """The strength-3 rows of full that quick and standard's arrays do not already hold."""
    from conformance.space.profiles import generated

    pinned = handwritten()
    have = {s.id for s in generated("data_parallel", pinned)}
    return [s for s in generated("data_parallel", pinned, full=True) if s.id not in have]


def handwritten() -> list[Scenario]:
    """The hand-written scenarios: kept by name, counted as covering first."""
    out = [
        make("plain", "mlp", w=1),
        make("plain", "mlp", w=2),
        make("plain", "mlp", w=3, profiles=STANDARD),
        make("plain", "mlp", w=4, profiles=STANDARD),
        make("uneven", "mlp", w=4, batch=5, description="5 rows over 4 replicas"),
        make("uneven", "mlp", w=3, batch=7, profiles=STANDARD, description="7 rows over 3 replicas"),
        make("fewer-rows", "mlp", w=4, batch=3, profiles=STANDARD,
             description="3 rows over 4 replicas: some replicas get no rows (or do not run)"),
        make("one-row", "mlp", w=2, batch=1, profiles=STANDARD, description="a single row"),
        make("dict", "dict-in", w=2, description="dict input with a non-tensor entry"),
        make("dict", "dict-in", w=3, batch=7, profiles=STANDARD),
        make("tuple", "tuple-in", w=2, description="tuple input, tuple output"),
        make("tuple", "tuple-in", w=4, batch=6, profiles=STANDARD),
        make("multi-arg", "multi-arg", w=2, profiles=STANDARD, description="two inputs, nested dict output"),
        make("multi-arg", "multi-arg", w=3, batch=5, profiles=STANDARD),
        make("dim1", "batch-dim1", w=2, profiles=STANDARD, description="scatter/gather along dim 1"),
        make("bn-eval", "cnn-bn-eval", w=2, exact_data=False, description="BatchNorm in eval mode: running stats"),
        make("bn-eval", "cnn-bn-eval", w=4, batch=6, exact_data=False, profiles=STANDARD),
        make("tied", "tied", w=2, profiles=STANDARD, description="tied weights: both uses reduce into one grad"),
        make("tied", "tied", w=3, batch=5, profiles=FULL),
        make("frozen", "frozen", w=2, description="frozen layer keeps grad None"),
        make("embedding", "embedding", w=2, profiles=STANDARD),
        make("fp64-dict", "dict-in", w=2, dtype="float64"),
        make("transformer", "transformer", w=2, exact_data=False, profiles=STANDARD),
        make("transformer", "transformer", w=3, batch=5, exact_data=False, profiles=FULL),
        make("many-tiny", "many-tiny", w=2, profiles=FULL),
        make("mixed-dtype", "mixed-dtype", w=2, profiles=FULL),
        make("fp64", "mlp", w=3, dtype="float64", profiles=STANDARD),
        make("sgd", "mlp", w=2, optimizer="sgd", steps=3, exact_data=True, profiles=STANDARD,
             description="SGD steps between data_parallel calls (weights leave the integers: re-anchored steps bitwise, a band straight through)"),
        make("adam", "mlp", w=2, optimizer="adam", steps=3, exact_data=True, profiles=FULL),
    ]
    out += [
        make("nested", "nested-io", w=2, switches={"input_grad": True},
             description="namedtuple holding a list in (and a str), namedtuple with a list and None out; input grads"),
        make("nested", "nested-io", w=3, batch=7, profiles=STANDARD, switches={"input_grad": True}),
        make("dim-last", "batch-last", w=2, description="3-D inputs, batch on the last dim (dim=-1)"),
        make("dim-last", "batch-last", w=3, batch=5, profiles=STANDARD),
        make("input-grad", "mlp", w=3, batch=5, switches={"input_grad": True}, profiles=STANDARD,
             description="inputs require grad: their gradient flows back through scatter"),
        make("input-grad", "multi-arg", w=2, switches={"input_grad": True}, profiles=STANDARD),
        make("scalar-out", "scalar-out", w=2, description="a 0-dim output per replica: gathered into a vector"),
        make("scalar-out", "scalar-out", w=4, batch=8, profiles=STANDARD),
        make("bn-train", "cnn-bn-train", w=2, batch=8, exact_data=False,
             description="BatchNorm in train mode: per-replica batch statistics; running stats follow replica 0"),
        make("bn-train", "cnn-bn-train", w=4, batch=8, exact_data=False, profiles=STANDARD),
        make("no-grad", "mlp", w=2, switches={"no_grad": True},
             description="a last call under torch.no_grad(): same output, no graph, gradients untouched"),
        make("no-grad", "dict-in", w=3, batch=7, switches={"no_grad": True}, profiles=STANDARD),
        make("frozen", "frozen", w=3, batch=5, profiles=STANDARD),
    ]
    for model in ("mlp", "dict-in", "tuple-in", "multi-arg"):
        for w in (1, 2, 3, 4):
            out.append(make("sweep", model, w=w, batch=2 * w + 1, steps=3, profiles=FULL))
    return out + kwargs_and_ambient_state_scenarios()


def kwargs_and_ambient_state_scenarios() -> list[Scenario]:
    """Keyword arguments and the ambient state of the call (issue 30): who / when / how often / inputs / ambient state (docs/contracts/data_parallel.md,
    "Dimension checklist"): keyword arguments, autocast and grad mode in the replicas' threads,
    a mode switch and an evaluation call before training, fp64 per-replica scalars."""
    autocast = {w: autocast_rule(w) for w in (2, 3)}
    return [
        make("kwargs", "kwargs-in", w=2, description="module_kwargs: a per-row tensor and a number"),
        make("kwargs", "kwargs-in", w=3, batch=7, profiles=STANDARD),
        make("kwargs-dim1", "kwargs-dim1", w=2, description="module_kwargs split along dim=1 like the inputs"),
        make("autocast", "mlp", w=2, switches={"autocast": True}, tolerance=autocast[2], exact_data=True,
             description="every forward under torch.autocast(bfloat16): the replicas' threads see it"),
        make("autocast", "kwargs-in", w=3, batch=6, switches={"autocast": True}, tolerance=autocast[3], exact_data=True,
             profiles=STANDARD),
        make("no-grad-first", "mlp", w=2, switches={"no_grad_first": True},
             description="an evaluation call under torch.no_grad() before the training calls"),
        make("eval-last", "cnn-bn-train", w=2, batch=8, exact_data=False, switches={"eval_last": True},
             description="module.eval() before the last call: the replicas follow the module's mode at each call"),
        make("scalar-out", "scalar-out", w=2, dtype="float64",
             description="fp64 per-replica scalars keep their dtype in the gathered vector"),
        # ambient x the other clauses: autocast with nested outputs and input grads, along dim 1, with frozen
        # and tied parameters (the replicas' threads must see it whatever the data's shape)
        # continuous data: nested-io's outputs are fp32 with or without autocast, only bf16-rounded values show it
        make("autocast-nested", "nested-io", w=2, switches={"autocast": True, "input_grad": True},
             tolerance=autocast[2], exact_data=False, profiles=STANDARD,
             description="nested inputs and outputs, input gradients, under torch.autocast(bfloat16)"),
        make("autocast-dim1", "batch-dim1", w=2, switches={"autocast": True}, tolerance=autocast[2], exact_data=True,
             profiles=STANDARD, description="scatter and gather along dim 1 under torch.autocast(bfloat16)"),
        make("autocast-frozen", "frozen", w=2, switches={"autocast": True}, tolerance=autocast[2], exact_data=True,
             profiles=STANDARD, description="a frozen layer under torch.autocast(bfloat16): its grad stays None"),
        # round 9: per-replica scalars under autocast (D14), BatchNorm's train-mode update under no_grad (D9)
        make("autocast-scalar-out", "scalar-out", w=2, switches={"autocast": True}, tolerance=autocast[2],
             exact_data=True, profiles=STANDARD,
             description="0-dim outputs under torch.autocast(bfloat16): one entry per replica, in their dtype"),
        make("bn-train-no-grad", "cnn-bn-train", w=2, batch=8, exact_data=False, switches={"no_grad": True},
             profiles=STANDARD, description="a train-mode BatchNorm called under torch.no_grad(): replica 0's "
             "running-statistics update still wins"),
    ]
