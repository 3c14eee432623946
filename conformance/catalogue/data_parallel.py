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

from conformance.catalogue.data_parallel_scenario import (  # noqa: F401 - the catalogue's names, kept here
    EXACT_SUMS,
    INEXACT_MODELS,
    autocast_rule,
    make,
    replica_rule,
)
from conformance.catalogue.profiles import FULL, STANDARD
from conformance.spec import Scenario


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
