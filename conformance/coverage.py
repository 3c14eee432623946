"""Per engine, how many of each area's possible feature pairs a profile covers (issue 38).

A pair an engine cannot run (every scenario holding it is skipped for a capability it lacks, or
a limit its adapter declares) is reported uncovered with that reason, never dropped; pairs the
area's constraints exclude are counted apart, each constraint named
(`conformance.space.coverage`). Shared by `gradparity list --coverage` and the HTML report.
"""

from __future__ import annotations

from conformance import catalogue
from conformance.adapters import registry
from conformance.plan import _capability_skip
from conformance.space import coverage
from conformance.space.profiles import AREAS


def per_adapter(profile: str, specs: tuple[str, ...] = (), areas: tuple[str, ...] = ()) -> list[dict]:
    """One record per (adapter, area with a space): pairs possible / covered, and the uncovered ones."""
    out = []
    for area in areas or tuple(AREAS):
        scenarios = catalogue.select(area=area, profile=profile)
        for spec in specs or registry.DEFAULT_ADAPTERS:
            try:
                adapter = registry.load(spec)
            except Exception as exc:  # an optional engine may be missing: say so
                out.append({"adapter": spec, "area": area, "error": str(exc).splitlines()[0][:120]})
                continue
            if adapter.area != area:
                continue
            c = coverage.pairs(area, profile, scenarios, lambda s, a=adapter: _capability_skip(a, s))
            out.append({"adapter": spec, "area": area, "profile": profile, "possible": c.possible,
                        "covered": c.covered, "excluded": c.excluded,
                        "uncovered": [{"pair": {k: str(v) for k, v in p.items()}, "why": why} for p, why in c.uncovered]})
    return out


def exclusions(area: str) -> list[dict]:
    """The pairs the area's constraints exclude, with the constraints' names and reasons."""
    reasons = {c.name: c.reason for c in AREAS[area].constraints}
    return [{"pair": {k: str(v) for k, v in p.items()}, "constraints": list(names),
             "why": "; ".join(reasons[n] for n in names)} for p, names in coverage.exclusions(area)]
