"""Profiles generated from each area's space: the covering arrays behind quick, standard and full.

- `standard`: every allowed pair of values of any two dimensions (strength 2);
- `full`: every allowed triple (strength 3), world size 8 added;
- `quick`: every allowed pair of the dimensions in `QUICK_CORE`, the others at their defaults,
  at most `QUICK_BUDGET` rows.
An area whose engines differ in what they offer (sharded: meshes, units, placement ...) names
*tiers*, each the subspace some engines run (values restricted, and constraints of their own for
what those engines refuse); `standard` then also covers every pair of each tier in rows inside
it, so an engine still meets every pair it can run (the pairwise array alone may put a pair only
into rows that engine skips).
The hand-written catalogue stays pinned (upstream regressions keep their names): its scenarios
are read as rows (`project`) and count as covering first, so the generator only adds rows for
the pairs they leave out.

Generating the DDP standard array takes seconds, too long for every process that loads the
catalogue, and its output is deterministic: the rows are kept in `generated/<area>-<profile>.json`
with the fingerprint of what they were generated from. A file whose fingerprint does not match
is ignored and the rows are generated again (`python -m conformance.space.profiles` rewrites
the files; tests/conformance/space checks that they are current).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from conformance.space import (
    bucketer,
    bucketer_rows,
    data_parallel,
    data_parallel_rows,
    ddp,
    ddp_rows,
    dist_autograd,
    dist_autograd_rows,
    sharded,
    sharded_rows,
)
from conformance.space.covering import Dimension, Row, Space, excluded, generate, violations
from conformance.spec import Scenario

STORE = Path(__file__).parent / "generated"
QUICK_BUDGET = 8


@dataclass(frozen=True)
class AreaSpace:
    """One area's dimensions and constraints, and how its rows become scenarios."""

    area: str
    dimensions: tuple[Dimension, ...]
    constraints: tuple
    to_scenario: Callable[..., Scenario]
    project: Callable[[Scenario], dict | None]
    quick_core: tuple[str, ...]
    full_values: dict
    # (who, {dimension: the values they run, None: the default only}, constraints of their own)
    tiers: tuple = ()

    def space(self, profile: str = "standard") -> Space:
        """The space a profile covers; "tier-<i>" is the subspace of `tiers[i]`."""
        dims = self.dimensions
        if profile == "full":
            dims = tuple(Dimension(d.name, self.full_values.get(d.name, d.values), d.doc) for d in dims)
        elif profile == "quick":
            dims = tuple(d if d.name in self.quick_core else Dimension(d.name, d.values[:1], d.doc) for d in dims)
        elif profile.startswith("tier-"):
            _, values, constraints = self.tiers[int(profile.removeprefix("tier-"))]
            dims = tuple(Dimension(d.name, values[d.name] or d.values[:1], d.doc) if d.name in values else d
                         for d in dims)
            return Space(dims, self.constraints + tuple(constraints))
        return Space(dims, self.constraints)


AREAS: dict[str, AreaSpace] = {
    "ddp": AreaSpace("ddp", ddp.DIMENSIONS, ddp.CONSTRAINTS, ddp_rows.scenario, ddp_rows.project,
                     quick_core=("data", "broadcast_buffers", "bucket_view"), full_values=ddp.FULL_VALUES),
    "sharded": AreaSpace("sharded", sharded.DIMENSIONS, sharded.CONSTRAINTS, sharded_rows.scenario,
                         sharded_rows.project, quick_core=("optimizer",), full_values=sharded.FULL_VALUES,
                         tiers=sharded.TIERS),
    "bucketer": AreaSpace("bucketer", bucketer.DIMENSIONS, bucketer.CONSTRAINTS, bucketer_rows.scenario,
                          bucketer_rows.project, quick_core=("form", "empty"), full_values=bucketer.FULL_VALUES,
                          tiers=bucketer.TIERS),
    "data_parallel": AreaSpace("data_parallel", data_parallel.DIMENSIONS, data_parallel.CONSTRAINTS,
                               data_parallel_rows.scenario, data_parallel_rows.project,
                               quick_core=("grad_mode", "autocast"), full_values=data_parallel.FULL_VALUES),
    "dist_autograd": AreaSpace("dist_autograd", dist_autograd.DIMENSIONS, dist_autograd.CONSTRAINTS,
                               dist_autograd_rows.scenario, dist_autograd_rows.project,
                               quick_core=("call", "structure"), full_values=dist_autograd.FULL_VALUES),
}
STRENGTH = {"quick": 2, "standard": 2, "full": 3}
TAG = {"quick": "core", "standard": "pairs", "full": "triples"}


def fingerprint(space: Space, strength: int, pinned: Iterable[dict]) -> str:
    """What the rows depend on: the dimensions, the constraints' names and reasons, the pinned rows,
    the strength (a changed predicate with the same name is caught by the test that regenerates)."""
    text = repr(([(d.name, d.values) for d in space.dimensions], [(c.name, c.reason, c.reads) for c in space.constraints],
                 strength, sorted(map(repr, pinned))))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pinned_rows(area: str, pinned: Iterable[Scenario], profile: str) -> list[dict]:
    a = AREAS[area]
    rows = [a.project(s) for s in pinned if profile in s.profiles]
    allowed = {d.name: d.values for d in a.space(profile).dimensions}
    return [r for r in rows if r is not None and all(r[k] in allowed[k] for k in allowed)]


def key_of(area: str, profile: str, pinned: list[dict]) -> str:
    """The fingerprint a profile's stored rows must carry (the tiers' too, in standard)."""
    a, strength = AREAS[area], STRENGTH[profile]
    key = fingerprint(a.space(profile), strength, pinned)
    if profile == "standard":
        key += "".join("+" + fingerprint(a.space(f"tier-{i}"), strength, pinned) for i in range(len(a.tiers)))
    return key


def fresh_rows(area: str, profile: str, pinned: list[dict]) -> list[dict]:
    """Generate a profile's rows; standard adds rows for each tier's pairs that the pinned and
    generated rows inside it leave uncovered."""
    a, strength = AREAS[area], STRENGTH[profile]
    rows = generate(a.space(profile), strength, pinned=pinned)
    for i in range(len(a.tiers) if profile == "standard" else 0):
        inside = a.space(f"tier-{i}")
        rows += generate(inside, strength, pinned=[r for r in (*pinned, *rows) if within(inside, r)])
    return rows


def within(space: Space, row: dict) -> bool:
    """Whether `row` lies in `space` (its values, and no constraint broken)."""
    allowed = {d.name: {repr(v) for v in d.values} for d in space.dimensions}
    return all(repr(row[k]) in allowed[k] for k in allowed) and not violations(space, [row])


def rows_for(area: str, profile: str, pinned: list[dict]) -> list[dict]:
    """The generated rows (stored ones when their fingerprint matches)."""
    path = STORE / f"{area}-{profile}.json"
    if path.exists():
        stored = json.loads(path.read_text())
        if stored.get("fingerprint") == key_of(area, profile, pinned):
            return stored["rows"]
    rows = fresh_rows(area, profile, pinned)
    if profile == "quick" and len(rows) > QUICK_BUDGET:
        raise RuntimeError(f"{area} quick: {len(rows)} rows cover the core pairs, over the budget of {QUICK_BUDGET}")
    return rows


@functools.cache
def _generated(area: str, pinned: tuple[Scenario, ...], profiles: tuple[str, ...]) -> tuple[Scenario, ...]:
    from conformance.catalogue.profiles import FULL, QUICK, STANDARD

    tags = {"quick": QUICK, "standard": STANDARD, "full": FULL}
    a = AREAS[area]
    out = []
    for profile in profiles:
        for row in rows_for(area, profile, pinned_rows(area, pinned, profile)):
            out.append(a.to_scenario(row, tags[profile], TAG[profile]))
    return tuple(out)


def generated(area: str, pinned: Iterable[Scenario], full: bool = False) -> list[Scenario]:
    """The area's generated scenarios, each in the cheapest profile whose array needs it; the
    strength-3 array (hundreds of rows) only when `full` is asked for (`catalogue.select`)."""
    pinned = tuple(pinned)
    out, seen = [], {s.id for s in pinned}
    for s in _generated(area, pinned, ("quick", "standard", "full") if full else ("quick", "standard")):
        if s.id not in seen:
            seen.add(s.id)
            out.append(s)
    return out


def write_store(area: str, pinned: list[Scenario], profiles: Iterable[str] = ("quick", "standard")) -> None:
    STORE.mkdir(exist_ok=True)
    for profile in profiles:
        rows = pinned_rows(area, pinned, profile)
        fresh = fresh_rows(area, profile, rows)
        data = {"area": area, "profile": profile, "strength": STRENGTH[profile],
                "fingerprint": key_of(area, profile, rows), "rows": fresh}
        (STORE / f"{area}-{profile}.json").write_text(json.dumps(data, indent=0) + "\n")
        print(f"{area} {profile}: {len(fresh)} rows", file=sys.stderr)
        if profile != "quick":
            store_exclusions(area, profile)


def store_exclusions(area: str, profile: str) -> None:
    """Add the space's excluded pairs to its stored array: `[i, v, j, w, [constraint, ...]]`, the
    dimensions' and values' indices. Proving a pair excluded is a search over every completion
    (tens of seconds for DDP), and every report counts the pairs: a torchrun rank 0 writing its
    report after each case outlived the agent's grace period computing them."""
    path = STORE / f"{area}-{profile}.json"
    data = json.loads(path.read_text())
    space = AREAS[area].space(profile)
    names = [d.name for d in space.dimensions]
    reprs = [[repr(v) for v in d.values] for d in space.dimensions]
    rows = []
    for pair, why in excluded(space, 2):
        (a, va), (b, vb) = pair.items()
        i, j = names.index(a), names.index(b)
        rows.append([i, reprs[i].index(repr(va)), j, reprs[j].index(repr(vb)), list(why)])
    data["excluded_pairs"] = {"fingerprint": fingerprint(space, 2, ()), "pairs": rows}
    path.write_text(json.dumps(data, indent=0) + "\n")
    print(f"{area} {profile}: {len(rows)} excluded pairs", file=sys.stderr)


def exclusions(area: str, profile: str) -> list[tuple[Row, tuple[str, ...]]]:
    """The pairs of the area's space for `profile` (quick's is standard's) that its constraints
    exclude, each with the constraints' names: the stored ones when current, else computed."""
    profile = "standard" if profile == "quick" else profile
    space = AREAS[area].space(profile)
    path = STORE / f"{area}-{profile}.json"
    stored = json.loads(path.read_text()).get("excluded_pairs") if path.exists() else None
    if not stored or stored["fingerprint"] != fingerprint(space, 2, ()):
        return excluded(space, 2)
    dims = space.dimensions
    return [({dims[i].name: dims[i].values[v], dims[j].name: dims[j].values[w]}, tuple(why))
            for i, v, j, w, why in stored["pairs"]]
