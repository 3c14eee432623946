"""The DDP scenario catalogue.

How one scenario is made (its id, required capabilities and tolerance, with the tolerance
policy) is `conformance.catalogue.ddp_scenario`; `make` and `FUF` are re-exported here.
"""

from __future__ import annotations

from conformance.catalogue import ddp_checklist, ddp_features, realistic, training_loop
from conformance.catalogue.ddp_scenario import FUF, make
from conformance.catalogue.profiles import FULL, QUICK, STANDARD
from conformance.spec import Expect, Scenario, WrapOptions

# Models with parameters whose true gradient is exactly zero (attention's key bias; a conv
# bias feeding BatchNorm). With 3+ ranks the gradient is rounding noise of a different
# summation order, and Adam (which normalizes by its magnitude) turns that noise into
# full-size steps: such pairs are not a meaningful check, so Adam runs them at 1-2 ranks only.
ZERO_GRADIENT_MODELS = frozenset({"transformer", "cnn-bn"})


def handwritten(area: str = "ddp") -> list[Scenario]:
    """The hand-written scenarios (upstream regressions by name, the zoo's families)."""
    m = lambda *a, **k: make(*a, area=area, **k)  # noqa: E731
    out = [*_basics(m), *_bucketing(m), *_unused_parameters(m), *_no_sync(m), *_model_structure(m), *_data(m),
           *_precision_and_compression(m)]
    if area in ("ddp", "sharded"):
        # The generated pairwise array covers the base list's standard variants (another world
        # size, model or bucket cap of a quick scenario): those that vary one thing move to full;
        # the quick ones, the upstream regressions and the composed ones (`composed`) stay pinned
        # in standard.
        out = [s.with_(profiles=FULL) if s.profiles == STANDARD and not s.upstream and not composed(s) else s
               for s in out]
    out += realistic.scenarios(m)  # issue 39: GPT, Llama, MoE, ResNet (conformance/catalogue/realistic.py)
    if area == "ddp":  # the training-loop scenarios (conformance/catalogue/training_loop.py)
        out += training_loop.scenarios(m)
        out += ddp_checklist.scenarios(m)  # issue 30's checklist cells (conformance/catalogue/ddp_checklist.py)
    out += _sweeps(m)
    if area == "ddp":  # production-training features (join, AMP, compile ...): their own module
        out += ddp_features.scenarios()
    return out


# Values a scenario's maker picks on its own (the data regime follows the world size), or that
# say where it runs rather than what it combines: not counted as a choice by `composed`.
_NOT_CHOSEN = ("model", "world", "data")


def composed(s: Scenario) -> bool:
    """Whether a hand-written scenario puts two or more non-default options together.

    Such a scenario is a combination someone wrote on purpose, on the model where it shows
    (`unused-static-graph/branches/w2`: static_graph with a parameter one rank leaves unused). The
    pairwise array holds each of its pairs somewhere, but possibly on a model or world size where
    the two do not meet (the rank dependence needs a third value), so it stays pinned in standard.
    """
    from conformance.space.ddp_rows import DEFAULTS, project

    row = project(s)
    if row is None:
        return False
    return sum(1 for k, v in row.items() if k not in _NOT_CHOSEN and v != DEFAULTS[k]) >= 2


def _basics(m) -> list[Scenario]:
    """The basics, and construction-time sync (every model has rank-dependent init)."""
    return [
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
    ]


def _bucketing(m) -> list[Scenario]:
    """Bucketing."""
    return [
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
    ]


def _unused_parameters(m) -> list[Scenario]:
    """Unused parameters."""
    return [
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
    ]


def _no_sync(m) -> list[Scenario]:
    """No_sync accumulation."""
    return [
        m("no-sync", "mlp", micro_batches=3),
        m("no-sync", "mlp", w=3, micro_batches=2, profiles=STANDARD),
        m("no-sync-control-flow", "branches", options=FUF, micro_batches=3, model_kwargs={"mode": "micro-flow"},
          description="a parameter used only in the first (no_sync) micro-batch", upstream="pytorch/pytorch#69031"),
        m("no-sync-adam", "transformer", micro_batches=2, optimizer="adam", profiles=STANDARD),
    ]


def _model_structure(m) -> list[Scenario]:
    """Model structure."""
    return [
        m("tied", "tied"),
        m("tied", "tied", w=4, profiles=STANDARD),
        m("tied-bf16", "tied", dtype="bfloat16", profiles=STANDARD,
          description="a weight used twice in one step, bf16 parameters (the DeepSpeed #8224 class: a reused "
                      "submodule under bf16)"),
        m("frozen", "frozen"),
        m("mixed-dtype", "mixed-dtype"),
        m("sparse", "embedding", model_kwargs={"sparse": True}),
        m("sparse", "embedding", w=3, model_kwargs={"sparse": True}, profiles=STANDARD),
        m("dense-embedding", "embedding", profiles=STANDARD),
    ]


def _data(m) -> list[Scenario]:
    """Data."""
    return [
        m("uneven", "mlp", shard_sizes=(2, 6)),
        m("uneven", "mlp", w=3, shard_sizes=(1, 2, 5), profiles=STANDARD),
        m("uneven", "cnn-bn", w=4, shard_sizes=(2, 4, 2, 8), profiles=STANDARD),
    ]


def _precision_and_compression(m) -> list[Scenario]:
    """Precision and compression."""
    return [
        m("fp16-params", "mlp", dtype="float16", profiles=STANDARD),
        m("bf16-params", "mlp", dtype="bfloat16", profiles=STANDARD),
        m("gas-bf16", "mlp", dtype="bfloat16", micro_batches=2, profiles=STANDARD,
          description="bf16 parameters, two micro-batches accumulated per step (an engine's gradient accumulation: "
                      "DeepSpeed's gradient_accumulation_steps with ZeRO 0-3, the PR #5154 / PR #7985 class)"),
        m("gas-fp16", "mlp", dtype="float16", micro_batches=2, profiles=STANDARD,
          description="fp16 parameters, two micro-batches accumulated per step (DeepSpeed: the dynamic loss scaler "
                      "scales loss / gradient_accumulation_steps; an overflow in either micro-batch skips the step)"),
        m("fp64-params", "mlp", dtype="float64", profiles=STANDARD),
        m("hook-allreduce", "mlp", options=WrapOptions(comm_hook="allreduce"), steps=2, profiles=STANDARD),
        m("hook-fp16", "mlp", options=WrapOptions(comm_hook="fp16")),
        m("hook-bf16", "mlp", options=WrapOptions(comm_hook="bf16"), profiles=STANDARD),
        m("reduce-bf16", "mlp", options=WrapOptions(reduce_dtype="bfloat16"),
          description="mixed_precision reduce_dtype=bf16: fp32 parameters, gradients reduced in bf16 and cast back"),
        m("reduce-bf16", "mlp", w=4, options=WrapOptions(reduce_dtype="bfloat16"), profiles=STANDARD),
        m("reduce-fp16", "transformer", w=3, options=WrapOptions(reduce_dtype="float16"), profiles=STANDARD),
        m("reduce-fp16-large-accumulated", "mlp", options=WrapOptions(reduce_dtype="float16"), micro_batches=3, steps=1,
          model_kwargs={"data_scale": 7}, exact_data=True, profiles=STANDARD,
          description="reduce_dtype=fp16, gradients near 2**14 accumulated over three micro-batches: the two ranks' "
                      "shares sum beyond fp16's range where their average does not (torch DDP divides each share "
                      "first; refimpl summed first until it was fixed)"),
    ]


def _sweeps(m) -> list[Scenario]:
    """Full: the core models across every world size and both optimizers."""
    out = []
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
    return out
