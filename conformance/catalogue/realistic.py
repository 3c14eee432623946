"""Scenarios on the realistic built-in models (issue 39): a GPT-style decoder, a Llama-style
decoder, a top-2 routed mixture of experts and a ResNet-style CNN (`conformance.models`).

They run with each model's own initialisation (rank-dependent: the factory is seeded per rank)
and continuous values, so no sum is exact by construction. What keeps the rules exact: every
rank's share is computed with the rank's own kernels (`conformance.baseline`), so at world
size 2 the cross-rank sum of two shares is order-free and bitwise; at 3-4 ranks it is bitwise
one summation order (`summation_order`). Adam runs at world size 2 only: GPT's attention key
bias has an exactly zero true gradient (softmax is shift-invariant), so beyond two ranks its
gradient is summation noise that Adam normalises into full-size steps.

The MoE model leaves experts without a token on some ranks and steps (its `used_experts`;
`tests/conformance/models/test_moe.py` shows it for these seeds), so every MoE scenario needs
find_unused_parameters; world size 4 is where an expert gradient divided by a wrong group size
(2 instead of 4) shows (`conformance.mutants.moe`).
"""

from __future__ import annotations

from collections.abc import Callable

from conformance.catalogue.profiles import QUICK, STANDARD
from conformance.spec import Scenario, WrapOptions, summation_order

FUF = WrapOptions(find_unused_parameters=True)


def scenarios(m: Callable[..., Scenario]) -> list[Scenario]:
    """The realistic models' scenarios, made by the area's `make` (`m`)."""
    def r(name: str, model: str, *, w: int = 2, **k) -> Scenario:  # their own init, continuous values
        return m(name, model, w=w, exact_data=False, tolerance=summation_order("float32", w), **k)

    moe = lambda *a, **k: r(*a, options=FUF, **k)  # noqa: E731
    return [
        r("plain", "gpt", steps=3, profiles=STANDARD,
          description="GPT-style decoder: tied embeddings (one weight, two uses), LayerNorm, causal attention"),
        r("adam", "gpt", steps=3, optimizer="adam", profiles=STANDARD),
        r("plain", "gpt", w=4, steps=2, profiles=STANDARD),
        r("no-sync", "gpt", micro_batches=2, profiles=STANDARD),
        # Dropout on (GPT-2's 0.1): each rank's masks come from its own RNG stream, which the
        # oracle replays from the state the rank recorded before each forward (conformance.models.rng).
        r("dropout", "gpt", steps=3, model_kwargs={"dropout": 0.1}, profiles=QUICK,
          description="GPT-2's default dropout: the oracle replays each rank's random-number stream"),
        r("dropout", "gpt", w=3, steps=3, model_kwargs={"dropout": 0.1}, micro_batches=2, profiles=STANDARD),
        r("plain", "llama", steps=3, profiles=STANDARD,
          description="Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention"),
        r("adam", "llama", steps=3, optimizer="adam", profiles=STANDARD),
        # Three steps at 3 ranks (here and for dropout): each step is bitwise to a summation order from
        # the engine's state, and the straight-through run is judged by the accumulated envelope
        # (conformance.oracle.trajectory), not a band, which Llama's large logit-sum gradients outgrew
        # by the second SGD step (a false failure; these scenarios used to stop after one step).
        r("plain", "llama", w=3, steps=3, profiles=STANDARD),
        moe("plain", "moe", steps=3, profiles=QUICK,
            description="top-2 of 8 experts with capacity and an aux loss: experts unused on some ranks and steps"),
        moe("adam", "moe", steps=3, optimizer="adam", profiles=STANDARD),
        moe("plain", "moe", w=4, steps=2, profiles=STANDARD,
            description="MoE at world size 4: an expert gradient averaged over a group of the wrong size shows"),
        moe("no-sync", "moe", micro_batches=2, profiles=STANDARD,
            description="MoE with accumulation: an expert idle in one micro-batch, used in the other"),
        r("plain", "resnet", steps=3, profiles=STANDARD,
          description="ResNet-style CNN: per-shard BatchNorm statistics, rank 0's running stats, residuals"),
        r("uneven", "resnet", shard_sizes=(2, 6), profiles=STANDARD),
    ]
