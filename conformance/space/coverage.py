"""Pair coverage of a set of scenarios over an area's space, per engine.

A pair of values is *possible* when the area's constraints allow it (`covering.allowed_tuples`),
*excluded* otherwise (the constraint's name says why), and *covered* for an engine when a
scenario holding it runs for that engine. A pair whose only scenarios are skipped for the
engine (a capability it lacks) is *uncovered*, with the skip reason: never silently dropped.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from conformance.space import profiles
from conformance.space.profiles import AREAS
from conformance.spec import Scenario


@dataclass
class PairCoverage:
    area: str
    possible: int
    covered: int
    excluded: int
    uncovered: list[tuple[dict, str]] = field(default_factory=list)  # (pair, why)

    def line(self) -> str:
        return f"{self.area}: {self.covered}/{self.possible} pairs covered ({self.excluded} excluded by constraints)"


@functools.cache
def _allowed(area: str, profile: str) -> tuple:
    """Every pair of the space but the excluded ones (stored with the arrays: proving a pair
    excluded searches its completions, tens of seconds for DDP)."""
    space = AREAS[area].space("standard" if profile == "quick" else profile)
    out = {tuple((k, repr(v)) for k, v in pair.items()) for pair, _ in exclusions(area, profile)}
    pairs = tuple(((a.name, x), (b.name, y)) for a, b in itertools.combinations(space.dimensions, 2)
                  for x in a.values for y in b.values if ((a.name, repr(x)), (b.name, repr(y))) not in out)
    return pairs, len(out)


@functools.cache
def _exclusions(area: str, profile: str) -> tuple:
    return tuple(profiles.exclusions(area, profile))


def exclusions(area: str, profile: str = "standard") -> list[tuple[dict, tuple[str, ...]]]:
    return list(_exclusions(area, profile))


def pairs(area: str, profile: str, scenarios: Iterable[Scenario],
          skip: Callable[[Scenario], str] = lambda s: "") -> PairCoverage:
    """How many of the area's possible pairs `scenarios` cover when `skip(s)` (a reason, "" to run)
    says which of them run. The quick profile is measured against standard's pairs."""
    possible, n_excluded = _allowed(area, profile)
    project = AREAS[area].project
    names = [d.name for d in AREAS[area].dimensions]
    held: dict[tuple, str] = {}  # pair -> "" when some running scenario holds it, else the first skip reason
    for s in scenarios:
        row = project(s)
        if row is None:
            continue
        row = {name: row[name] for name in names}  # the space's order, as the possible pairs are keyed
        why = skip(s)
        for a, b in itertools.combinations(row.items(), 2):
            key = (_key(a), _key(b))
            if held.get(key, None) != "":
                held[key] = why if key not in held or why == "" else held[key]
    uncovered = []
    for pair in possible:
        key = tuple(_key(p) for p in pair)
        if held.get(key) != "":
            uncovered.append((dict(pair), held.get(key) or "no scenario of the profile holds it"))
    return PairCoverage(area, len(possible), len(possible) - len(uncovered), n_excluded, uncovered)


def _key(item: tuple) -> tuple:
    return item[0], repr(item[1])
