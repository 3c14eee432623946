"""Which clauses of `docs/contracts/sharded.md` a sharded scenario exercises (`clauses_of`).

A module of its own so that the family modules (`sharded_families`, `sharded_precision`,
`sharded_clip`) and `conformance.catalogue.sharded`, which lists them, all import it without an
import circle. S3 (shard layout) and S12 (local shards) come from the model itself: a parameter
whose size the world size does not divide, so a shard carries padding.
"""

from __future__ import annotations

import functools

from conformance.spec import Scenario

# Models with buffers that training updates (see `conformance.catalogue.sharded`).
BUFFER_READING_MODELS = {"buffered", "cnn-bn", "resnet"}


def _padded(s: Scenario) -> bool:
    """Whether some parameter's size is not a multiple of the world size (a padded shard)."""
    if s.world_size == 1:
        return False
    return any(n % s.world_size for n in _parameter_sizes(s.model, s.model_kwargs))


@functools.cache
def _parameter_sizes(model: str, model_kwargs: tuple) -> tuple[int, ...]:
    """The model's parameter sizes (shapes depend on its name and kwargs only): built once per
    model, not once per scenario, as every process that loads the catalogue asks for them."""
    from conformance.models.data import build_model

    built = build_model(model, dict(model_kwargs), seed=0, rank=0, dtype="float32", device="cpu", exact=True)
    return tuple(p.numel() for p in built.parameters())


def clauses_of(s: Scenario) -> tuple[str, ...]:
    """The clauses of docs/contracts/sharded.md a scenario exercises."""
    c = {"S1", "S2"}
    if _padded(s):
        c.update(("S3", "S12"))  # S12: each rank's shard is its slice, padding zero (conformance/judge/shards.py)
    if s.optimizer != "none":
        c.add("S4")
    if s.micro_batches > 1:
        c.add("S5")
    if s.model == "branches" or s.options.find_unused_parameters:
        c.add("S6")
    if s.model in BUFFER_READING_MODELS:
        c.add("S7")
    if "rank-uses-no-param" in s.id:
        c.add("S8")
    if s.options.bucket_cap_mb is not None:
        c.add("S9")
    if s.dtype != "float32" or s.model == "mixed-dtype":
        c.add("S10")
    if s.shard_sizes and len(set(s.shard_sizes)) > 1:
        c.add("S11")
    return tuple(sorted(c, key=lambda x: int(x[1:])))
