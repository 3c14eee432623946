"""Every built-in model by name, with the properties a scenario generator needs to pick it.

A "model" dimension of the scenario space (DESIGN.md, "The scenario space") reads `MODELS`:
which models have dropout (the oracle replays each rank's RNG stream), buffers (a buffer rule
applies; sharded engines that never sync buffers skip them), parameters unused on some ranks
or steps (find_unused_parameters needed), experts (MoE families), exactness (small-integer
weights keep fp32 sums exact: the bitwise rule at any world size needs it), and which
kwargs turn a property on (`dropout_kwargs`). The builders and input specs are the zoo's
(`conformance.models.builtin.BUILTIN_MODELS`); this module only declares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from conformance.models.builtin import BUILTIN_MODELS, InputSpec


@dataclass(frozen=True)
class ModelInfo:
    """One built-in model: how to build it, its inputs, and what it exercises."""

    name: str
    build: Callable[..., nn.Module]
    inputs: InputSpec
    about: str
    has_dropout: bool = False  # RNG used in forward (only with `dropout_kwargs`)
    dropout_kwargs: tuple[tuple[str, float], ...] = ()
    has_buffers: bool = False  # buffers that training updates (BatchNorm running stats ...)
    has_unused_params: bool = False  # some parameter unused on some rank/step: find_unused_parameters
    is_moe: bool = False  # routed experts with an auxiliary loss
    has_tied_weights: bool = False
    realistic: bool = False  # a production architecture (continuous data, its own initialisation)
    exact_ok: bool = True  # small-integer weights keep every sum exact (bitwise at any world size)
    tags: frozenset[str] = field(default_factory=frozenset)


# Declared properties per model name; anything not listed is False.
_PROPERTIES: dict[str, dict] = {
    "cnn-bn": {"has_buffers": True},
    "buffered": {"has_buffers": True},
    "buffer-order": {"has_buffers": True},
    "branches": {"has_unused_params": True},
    "tied": {"has_tied_weights": True},
    "transformer": {"exact_ok": False},
    "gpt": {"has_dropout": True, "dropout_kwargs": (("dropout", 0.1),), "has_tied_weights": True,
            "realistic": True, "exact_ok": False},
    "llama": {"realistic": True, "exact_ok": False},
    "moe": {"has_unused_params": True, "is_moe": True, "realistic": True, "exact_ok": False},
    "resnet": {"has_buffers": True, "realistic": True, "exact_ok": False},
}

MODELS: dict[str, ModelInfo] = {
    name: ModelInfo(name, build, spec, about, **_PROPERTIES.get(name, {}))
    for name, (build, spec, about) in BUILTIN_MODELS.items()
}
REALISTIC: tuple[str, ...] = tuple(name for name, info in MODELS.items() if info.realistic)


def info(name: str) -> ModelInfo:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown built-in model {name!r}; known: {', '.join(sorted(MODELS))}") from None
