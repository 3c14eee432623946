"""Scenario catalogues per area and the named profiles (quick ⊂ standard ⊂ full).

Each area's catalogue is one module here; which areas exist (and which catalogue function is
each one's) is `conformance.area.AREAS`, the one registry.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from conformance.spec import Scenario

PROFILES = ("quick", "standard", "full")
# What a scenario lists in `profiles`: the cheapest profile it belongs to, and every larger one.
QUICK, STANDARD, FULL = (frozenset(PROFILES[i:]) for i in range(len(PROFILES)))
# Short dtype names used in scenario ids.
SHORT_DTYPE = {"float32": "fp32", "float64": "fp64", "float16": "fp16", "bfloat16": "bf16", "int64": "i64", "int32": "i32"}

@functools.cache
def all_scenarios() -> tuple[Scenario, ...]:
    from conformance.area import AREAS  # the registry imports every catalogue module

    out: list[Scenario] = []
    for area in AREAS.values():
        out.extend(area.scenarios())
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
