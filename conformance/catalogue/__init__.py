"""Scenario catalogues per area and the named profiles (quick ⊂ standard ⊂ full).

Each area's catalogue is one module here; which function lists an area's hand-written scenarios
is its entry's `catalogue` (`conformance/areas/<area>.py`). An area with a generated space adds
the covering arrays around them (`scenarios`); `SCENARIOS` maps every area to its list, in the
areas' order (the area registry, `conformance.area.AREAS`, one layer up, reads it from here).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from conformance import areas
from conformance.catalogue.profiles import FULL, PROFILES, QUICK, SHORT_DTYPE, STANDARD  # noqa: F401
from conformance.spec import Scenario

# Every area's hand-written scenarios (its entry's `catalogue`), in the areas' order.
HANDWRITTEN: dict[str, Callable[[], list[Scenario]]] = {e.name: areas.resolve(e.catalogue) for e in areas.ENTRIES}


def scenarios(area: str) -> list[Scenario]:
    """An area's scenarios of every profile but full's generated rows: the hand-written ones
    (pinned: they cover first, and upstream regressions keep their names) and, for an area with
    a generated space (`conformance.space.profiles.AREAS`), the covering arrays around them."""
    from conformance.space.profiles import AREAS as SPACES
    from conformance.space.profiles import generated

    pinned = HANDWRITTEN[area]()
    return pinned + generated(area, pinned) if area in SPACES else pinned


def full_generated(area: str) -> list[Scenario]:
    """The strength-3 rows of an area's full profile that quick and standard's arrays do not
    already hold: built only when full is selected (minutes when the stored array is stale)."""
    from conformance.space.profiles import AREAS as SPACES
    from conformance.space.profiles import generated

    if area not in SPACES:
        return []
    pinned = HANDWRITTEN[area]()
    have = {s.id for s in generated(area, pinned)}
    return [s for s in generated(area, pinned, full=True) if s.id not in have]


# Every area's scenarios (every profile; `select` filters), in the areas' order.
SCENARIOS: dict[str, Callable[[], list[Scenario]]] = {name: functools.partial(scenarios, name) for name in HANDWRITTEN}


@functools.cache
def all_scenarios(full: bool | str = False) -> tuple[Scenario, ...]:
    """Every scenario; the generated strength-3 arrays (`conformance.space`) only with `full`:
    True builds every area's, an area's name only that area's (an array whose stored rows are
    stale is regenerated, minutes of work: asking for dist_autograd's full profile must not
    build the DDP array)."""
    out: list[Scenario] = []
    for area, listed in SCENARIOS.items():
        out.extend(listed())
        if full is True or full == area:
            out.extend(full_generated(area))
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
