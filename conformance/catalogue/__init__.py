"""Scenario catalogues per area and the named profiles (quick ⊂ standard ⊂ full).

Each area registers two things: where its scenarios come from, and the module that runs them
(`run(payload, ctx)` inside rank processes, `check(scenario, adapter_spec, session)` in the
coordinator).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from conformance.harness.context import resolve
from conformance.spec import Scenario

PROFILES = ("quick", "standard", "full")
# What a scenario lists in `profiles`: the cheapest profile it belongs to, and every larger one.
QUICK, STANDARD, FULL = (frozenset(PROFILES[i:]) for i in range(len(PROFILES)))
# Short dtype names used in scenario ids.
SHORT_DTYPE = {"float32": "fp32", "float64": "fp64", "float16": "fp16", "bfloat16": "bf16", "int64": "i64", "int32": "i32"}

# area -> (scenario factory, driver module)
AREAS: dict[str, tuple[str, str]] = {
    "ddp": ("conformance.catalogue.ddp:scenarios", "conformance.runners.ddp"),
    "data_parallel": ("conformance.catalogue.data_parallel:scenarios", "conformance.runners.data_parallel"),
    "dist_autograd": ("conformance.catalogue.dist_autograd:scenarios", "conformance.runners.dist_autograd"),
    "bucketer": ("conformance.catalogue.bucketer:scenarios", "conformance.runners.bucketer"),
    "sharded": ("conformance.catalogue.sharded:scenarios", "conformance.runners.ddp"),
}


@functools.cache
def all_scenarios() -> tuple[Scenario, ...]:
    out: list[Scenario] = []
    for factory, _ in AREAS.values():
        out.extend(resolve(factory)())
    ids = [s.id for s in out]
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        raise RuntimeError(f"duplicate scenario ids in the catalogue: {sorted(dupes)}")
    return tuple(out)


def on_device(scenario: Scenario, device: str) -> Scenario:
    """The same scenario on another device type; its id says so."""
    if device == scenario.device:
        return scenario
    return scenario.with_(device=device, id=f"{scenario.id}/{device}")


def select(
    *,
    area: str | None = None,
    profile: str = "quick",
    world_sizes: Iterable[int] = (),
    device: str = "cpu",
    ids: Iterable[str] = (),
) -> list[Scenario]:
    """Scenarios of `area` in `profile`; explicit `ids` pick scenarios whatever their profile."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    ids, world_sizes = set(ids), set(world_sizes)
    chosen = []
    for s in all_scenarios():
        if area and s.area != area:
            continue
        base_id = s.id
        if ids:
            if base_id not in ids and f"{base_id}/{device}" not in ids:
                continue
        elif profile not in s.profiles:
            continue
        if world_sizes and s.world_size not in world_sizes:
            continue
        chosen.append(on_device(s, device))
    return chosen


def driver(area: str):
    import importlib

    return importlib.import_module(AREAS[area][1])
