"""DDP scenarios for production training: join, AMP, checkpointing, compile, clipping,
requires_grad toggles, checkpoint round trips and determinism (`conformance.features`).

Every family runs at world sizes 2 to 4 for at least 5 steps. Tolerances follow the DDP
catalogue (bitwise at 1-2 ranks on small-integer data, a summand-scaled fp32 band at 3-4);
autocast gradients are compared the same way because the oracle runs each shard under the
same autocast with the same kernels, so only the cross-rank fp32 sum can differ.
torch.compile scenarios use the `aot_eager` backend (Dynamo and AOT autograd, the parts
that interact with DDP's hooks, without a C++ toolchain) and a band: AOT autograd's traced
backward may order a reduction differently from eager. The quick profile keeps one scenario
per family that its zoo mutant needs (plus join with a zero-batch rank, join-throw and clip);
the rest are standard.
"""

from __future__ import annotations

from dataclasses import replace

from conformance.catalogue.ddp_scenario import FUF, make
from conformance.catalogue.profiles import FULL, QUICK, STANDARD
from conformance.spec import Capability as C
from conformance.spec import Expect, WrapOptions, float_tolerance

STEPS = 5
THROW_PATTERN = r"(?i)exhausted|throwing across all ranks|early termination"
REENTRANT_PATTERN = r"(?i)(marked|mark a variable) (as )?ready (only )?(once|twice)|static_graph"


def _f(**features) -> tuple:
    return tuple(sorted(features.items()))


def _join(name, w, counts, *, profiles=STANDARD, model="mlp", options=WrapOptions(), **features):  # noqa: B008
    extra = dict(features)
    throw = extra.get("throw_on_early_termination", False)
    return make(
        name, model, w=w, profiles=profiles, options=options, steps=max(counts),
        features=_f(join=tuple(counts), **extra), extra_requires=frozenset({C.JOIN}),
        expect=Expect.ERROR if throw else Expect.MATCH, error_pattern=THROW_PATTERN if throw else "",
        description=f"uneven inputs under join(): batches per rank {tuple(counts)}"
        + ("; every rank must raise once one runs out" if throw else ""),
        upstream="pytorch/pytorch#38174",
    )


def scenarios(area: str = "ddp") -> list:
    m = lambda *a, **k: make(*a, **{"profiles": STANDARD, **k})  # noqa: E731
    compile_band = lambda w: float_tolerance("float32", max(w, 2), "torch.compile (aot_eager): reductions may be reordered")  # noqa: E731
    out = [
        # -- uneven inputs with join
        _join("join-uneven", 2, (5, 3), profiles=QUICK),
        _join("join-zero-batches", 2, (5, 0), profiles=QUICK),
        _join("join-uneven", 3, (6, 5, 2)),
        _join("join-zero-batches", 4, (5, 0, 3, 1)),
        _join("join-active-divisor", 2, (5, 2), divide_by_initial_world_size=False),
        _join("join-active-divisor", 4, (6, 4, 2, 0), divide_by_initial_world_size=False),
        _join("join-buckets", 2, (5, 2), model="many-tiny", options=WrapOptions(bucket_cap_mb=0.001)),
        _join("join-unused", 2, (5, 3), model="branches", options=FUF, profiles=FULL),
        _join("join-throw", 2, (5, 3), throw_on_early_termination=True, profiles=QUICK),
        _join("join-throw", 3, (5, 5, 0), throw_on_early_termination=True),
        # -- mixed precision: autocast bf16 on CPU, with and without a GradScaler
        m("autocast-bf16", "mlp", w=2, steps=STEPS, features=_f(autocast="bfloat16")),
        m("autocast-bf16", "transformer", w=3, steps=STEPS, features=_f(autocast="bfloat16")),
        m("autocast-bf16-scaler", "mlp", w=2, steps=STEPS, profiles=QUICK,
          features=_f(autocast="bfloat16", grad_scaler=True, inf_at=(1, 2)),
          description="GradScaler; rank 1's step-2 input overflows, so every rank must skip step 2"),
        m("autocast-bf16-scaler", "mlp", w=4, steps=STEPS,
          features=_f(autocast="bfloat16", grad_scaler=True, inf_at=(3, 1))),
        m("grad-scaler", "mlp", w=2, steps=STEPS, features=_f(grad_scaler=True, inf_at=(0, 3))),
        # -- activation checkpointing
        m("ckpt-non-reentrant", "ckpt-mlp", w=2, steps=STEPS,
          features=_f(checkpoint="non-reentrant")),
        m("ckpt-non-reentrant", "ckpt-mlp", w=3, steps=STEPS, features=_f(checkpoint="non-reentrant")),
        m("ckpt-reentrant-static", "ckpt-mlp", w=2, steps=STEPS, profiles=QUICK,
          options=WrapOptions(static_graph=True), features=_f(checkpoint="reentrant")),
        m("ckpt-reentrant-static", "ckpt-mlp", w=4, steps=STEPS,
          options=WrapOptions(static_graph=True), features=_f(checkpoint="reentrant")),
        m("ckpt-reentrant", "ckpt-mlp", w=2, steps=STEPS, features=_f(checkpoint="reentrant"), description="reentrant checkpointing, each parameter in one segment"),
        m("ckpt-reentrant-shared", "ckpt-mlp", w=2, steps=STEPS,
          model_kwargs={"shared": True}, features=_f(checkpoint="reentrant"),
          expect=Expect.MATCH_OR_ERROR, error_pattern=REENTRANT_PATTERN,
          description="a layer in two reentrant segments without static_graph: a clear error, or right answers"),
        # -- torch.compile around the model and around the wrapper
        m("compile-model", "mlp", w=2, steps=STEPS, features=_f(compile="model"), tolerance=compile_band(2),
          timeout_s=180),
        m("compile-wrapper", "mlp", w=2, steps=STEPS, features=_f(compile="wrapper"), tolerance=compile_band(2),
          timeout_s=180),
        m("compile-buckets", "mlp", w=2, steps=STEPS, features=_f(compile="model"), tolerance=compile_band(2),
          options=WrapOptions(bucket_cap_mb=0.001), timeout_s=180, profiles=QUICK,
          description="torch.compile around the model, three buckets: the compiled backward returns gradients "
                      "in another order than eager"),
        m("compile-model", "mlp", w=3, steps=STEPS, features=_f(compile="model"), tolerance=compile_band(3),
          timeout_s=180, profiles=FULL),
        m("compiled-autograd", "mlp", w=2, steps=STEPS, features=_f(compile="compiled-autograd"),
          tolerance=compile_band(2), timeout_s=180, profiles=FULL, upstream="pytorch/pytorch#152735",
          description="every backward under compiled autograd (aot_eager): the reducer's collectives must still run"),
        # -- clip_grad_norm_ on the averaged gradients
        m("clip-grad-norm", "mlp", w=2, steps=STEPS, features=_f(clip=4.0), profiles=QUICK),
        m("clip-grad-norm", "mlp", w=4, steps=STEPS, features=_f(clip=1.0)),
        m("clip-grad-norm-scaler", "mlp", w=2, steps=STEPS,
          features=_f(clip=4.0, autocast="bfloat16", grad_scaler=True, inf_at=(0, 1))),
        # -- requires_grad toggled between iterations
        m("requires-grad-toggle", "mlp", w=2, steps=STEPS, options=FUF, profiles=QUICK,
          features=_f(freeze=((1, "layers.0", False), (3, "layers.0", True))),
          description="first layer frozen at step 1, unfrozen at step 3 (no grad, no momentum step while frozen)"),
        m("requires-grad-toggle", "mlp", w=3, steps=STEPS, options=FUF,
          features=_f(freeze=((2, "layers.1", False), (4, "layers.1", True)))),
        # -- checkpoint save / load mid-run
        m("checkpoint-round-trip", "mlp", w=2, steps=STEPS, optimizer="adam", profiles=QUICK,
          features=_f(save_load_at=2),
          description="train 2 steps, save wrapper + optimizer, rebuild everything from the checkpoint, train on"),
        m("checkpoint-round-trip", "cnn-bn", w=4, steps=STEPS, features=_f(save_load_at=2)),
        m("checkpoint-round-trip-scaler", "mlp", w=3, steps=STEPS,
          features=_f(save_load_at=3, autocast="bfloat16", grad_scaler=True, inf_at=(2, 1))),
        # -- determinism: the same scenario twice, bitwise
        m("determinism", "mlp", w=2, steps=STEPS, features=_f(repeat=2)),
        m("determinism", "mlp", w=4, steps=STEPS, features=_f(repeat=2), profiles=QUICK),
    ]
    out = [_amp_band(s) for s in out]
    return [s.with_(description=s.description or _describe(s)) for s in out]


def _amp_band(s):
    """Autocast at 3+ ranks: each step re-anchored, the fp32 gradients are bitwise to a summation
    order. Straight through, a 1-ulp fp32 difference in a parameter (another sum order) can flip
    a bf16 rounding in the next forward, so that second check keeps a band in bf16 terms."""
    if dict(s.features).get("autocast") and s.tolerance.kind == "summation-order":
        dtype = dict(s.features)["autocast"]
        band = float_tolerance(dtype, s.world_size, f"autocast {dtype}: fp32 sums of {s.world_size} ranks in "
                                                    f"another order feed {dtype} roundings over steps")
        return s.with_(tolerance=replace(s.tolerance, straight_through=band))
    return s


def _describe(s) -> str:
    from conformance.features import Features

    return Features.of(s).describe()
