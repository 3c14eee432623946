"""Scenario catalogues per area and the named profiles (quick ⊂ standard ⊂ full).

Each area's catalogue is one module here; which function lists an area's scenarios is its
entry's `catalogue` (`conformance/areas/<area>.py`), and `SCENARIOS` maps every area to it, in
the areas' order (the area registry, `conformance.area.AREAS`, one layer up, reads it from here).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from conformance import areas
from conformance.catalogue.profiles import FULL, PROFILES, QUICK, SHORT_DTYPE, STANDARD  # noqa: F401
from conformance.spec import Scenario

# Every area's scenarios (every profile; `select` filters), in the areas' order.
SCENARIOS: dict[str, Callable[[], list[Scenario]]] = {e.name: areas.resolve(e.catalogue) for e in areas.ENTRIES}


def _ddp_full_generated() -> list[Scenario]:
    from conformance.catalogue import ddp

    return ddp.full_generated()


def _sharded_full_generated() -> list[Scenario]:
    from conformance.catalogue import sharded

    return sharded.full_generated()


def _bucketer_full_generated() -> list[Scenario]:
    from conformance.catalogue import bucketer_generated

    return bucketer_generated.full_generated()


def _data_parallel_full_generated() -> list[Scenario]:
    from conformance.catalogue import data_parallel

    return data_parallel.full_generated()


# The generated full profile of an area (`conformance.space.profiles`): built only when selected.
GENERATED: dict[str, Callable[[], list[Scenario]]] = {"ddp": _ddp_full_generated, "sharded": _sharded_full_generated,
                                                      "bucketer": _bucketer_full_generated,
                                                      "data_parallel": _data_parallel_full_generated}


@functools.cache
def all_scenarios(full: bool | str = False) -> tuple[Scenario, ...]:
    """Every scenario; the generated strength-3 arrays (`conformance.space`) only with `full`:
    True builds every area's, an area's name only that area's (an array whose stored rows are
    stale is regenerated, minutes of work: asking for dist_autograd's full profile must not
    build the DDP array)."""
    out: list[Scenario] = []
    for area, scenarios in SCENARIOS.items():
        out.extend(scenarios())
        if area in GENERATED and (full is True or full == area):
            out.extend(GENERATED[area]())
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
    full: bool | str = profile == "full" if not ids else any("/triples/" in i for i in ids)
    if full and area and not ids:
        full = area
    for s in all_scenarios(full):
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
