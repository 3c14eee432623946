"""Scenario catalogues per area and the named profiles (quick ⊂ standard ⊂ full).

Each area's catalogue is one module here, and `SCENARIOS` says which function is each area's
(the area registry, `conformance.area.AREAS`, one layer up, reads it from here). The catalogue
knows nothing of the registry: it lists its own modules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from conformance.catalogue import bucketer, data_parallel, ddp, dist_autograd, sharded
from conformance.catalogue.profiles import FULL, PROFILES, QUICK, SHORT_DTYPE, STANDARD  # noqa: F401
from conformance.spec import AREA_NAMES, Scenario

# Every area's scenarios (every profile; `select` filters), in the order of `AREA_NAMES`.
SCENARIOS: dict[str, Callable[[], list[Scenario]]] = {
    "ddp": ddp.scenarios,
    "data_parallel": data_parallel.scenarios,
    "dist_autograd": dist_autograd.scenarios,
    "bucketer": bucketer.scenarios,
    "sharded": sharded.scenarios,
}
assert tuple(SCENARIOS) == AREA_NAMES, "conformance.catalogue: SCENARIOS and spec.AREA_NAMES disagree"


@functools.cache
def all_scenarios() -> tuple[Scenario, ...]:
    out: list[Scenario] = []
    for scenarios in SCENARIOS.values():
        out.extend(scenarios())
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
