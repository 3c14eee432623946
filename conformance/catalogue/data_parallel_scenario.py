"""The maker of `data_parallel` scenarios and its tolerance rules (the catalogue's and the generated space's).

Split from `conformance.catalogue.data_parallel` so the generated space
(`conformance.space.data_parallel_rows`) builds its rows with the same rules without importing
the catalogue that loads it. The rules are the catalogue's (see its docstring): exact with
small-integer data where every sum is exact in any order, else replayed replica by replica.
"""

from __future__ import annotations

from dataclasses import replace

from conformance.catalogue.profiles import QUICK
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
