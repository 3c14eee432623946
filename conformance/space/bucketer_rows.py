"""A row of the bucketer scenario space (`conformance.space.bucketer`) as a `Scenario`, and back.

`scenario(row)` builds a plan of kind ``space`` (`conformance.catalogue.bucketer_space`) with
the catalogue's own `make`, so a generated scenario is judged exactly like a hand-written one
(bitwise integer sums, exactly once, the documented order). Its id says every value that is not
the dimension's default, e.g. ``bucketer/pairs/small/w3/int64/group-world-and-pairs+form-keyword``.
`project(scenario)` reads any bucketer scenario as a row from the calls its plan makes (which
dtypes, groups, layouts, callbacks, special inputs), so the pinned catalogue counts towards
coverage and each generated row reads back as itself.
"""

from __future__ import annotations

from dataclasses import replace

from conformance.catalogue import bucketer as cat
from conformance.space.bucketer import CAPS, DIMENSIONS, DTYPES, GROUPS

DEFAULTS = {d.name: d.values[0] for d in DIMENSIONS}
_HEAD = ("world", "cap", "dtypes")


def _id(row: dict, tag: str) -> str:
    head = f"bucketer/{tag}/{row['cap']}/w{row['world']}/{row['dtypes']}"
    rest = [f"{k}-{v}" for k, v in row.items() if k not in _HEAD and v != DEFAULTS[k]]
    return head + ("/" + "+".join(rest) if rest else "")


def _clauses(row: dict) -> tuple[str, ...]:
    """The contract clauses (docs/contracts/bucketer.md) a row adds to the core ones."""
    on = {cat.IMMEDIATE: row["big"] == "yes" or row["cap"] in ("off", "negative"),
          cat.REUSE: row["reuse"] == "yes", cat.GROUPS: row["group"] != "world", cat.FORMS: row["form"] == "keyword",
          cat.LAYOUTS: row["layout"] != "contiguous" or row["zero_dim"] == "yes", cat.EMPTY: row["empty"] == "yes",
          cat.LIFECYCLE: row["rounds"] > 1 or row["idle_flush"] == "yes" or row["teardown"] == "queued"}
    return tuple(c for c, yes in on.items() if yes)


def scenario(row: dict, profiles: frozenset, tag: str = "pairs"):
    """The scenario of `row` in `profiles`; `tag` (core / pairs / triples) names its array in the id."""
    s = cat.make(tag, "space", w=row["world"], cap=CAPS[row["cap"]], dtypes=DTYPES[row["dtypes"]],
                 profiles=profiles, steps=row["rounds"], clauses=_clauses(row),
                 callbacks=row["callbacks"], group=row["group"], layout=row["layout"], zero_dim=row["zero_dim"],
                 empty=row["empty"], big=row["big"], keyword=row["form"] == "keyword", reuse=row["reuse"] == "yes",
                 idle_flush=row["idle_flush"] == "yes", teardown_queued=row["teardown"] == "queued",
                 description="generated from the bucketer space (conformance.space.bucketer): "
                             + ", ".join(f"{k}={v}" for k, v in row.items()))
    return replace(s, id=_id(row, tag))


def project(s) -> dict | None:
    """Any bucketer scenario as a row of the space, read from the calls its plan makes; None where a
    value is outside the space (two dtypes, a cap other than the space's, ambient state ...)."""
    if s.area != "bucketer":
        return None
    kw = s.kwargs()
    if kw.get("default_dtype") or kw.get("teardown_calls") or "teardown_shape" in kw:
        return None
    calls = cat.plan(s)
    cap = next((name for name, mb in CAPS.items() if mb == s.options.bucket_cap_mb), None)
    dtypes = next((name for name, ds in DTYPES.items() if set(ds) == {c.dtype for c in calls}), None)
    group = next((name for name, kinds in GROUPS.items() if set(kinds) == {c.group for c in calls}), None)
    layouts = {c.layout for c in calls}
    layout = "mixed" if len(layouts) == 3 else next(iter(layouts)) if len(layouts) == 1 else None
    with_fn = [c.callback for c in calls]
    big = [all(cat.must_be_immediate(s, c, r) for r in range(s.world_size)) for c in calls if c.numel > 0]
    some_big = [any(cat.must_be_immediate(s, c, r) for r in range(s.world_size)) for c in calls if c.numel > 0]
    if None in (cap, dtypes, group, layout) or not any(with_fn) or s.steps not in (1, 2, 3) or any(some_big) != any(big):
        return None
    return {
        "world": s.world_size, "cap": cap, "dtypes": dtypes,
        "callbacks": "all" if all(with_fn) else "some",
        "group": group, "layout": layout,
        "zero_dim": "yes" if any(c.shape == () for c in calls) else "no",
        "empty": "yes" if any(c.numel == 0 for c in calls) else "no",
        "big": "yes" if cap == "small" and any(big) else "no",
        "form": "keyword" if kw.get("keyword") else "positional",
        "reuse": "yes" if kw.get("reuse") else "no",
        "idle_flush": "yes" if kw.get("idle_flush") else "no",
        "rounds": s.steps,
        "teardown": "queued" if kw.get("teardown_queued") else "plain",
    }
