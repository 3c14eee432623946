"""A row of the dist_autograd scenario space (`conformance.space.dist_autograd`) as a `Scenario`, and back.

`scenario(row)` builds the generated composition (`conformance.models.dist_autograd_composed`:
the scenario's `model` is "composed", its `model_kwargs` the row), judged like every scenario of
the area against local autograd over the same composition, with the catalogue's band for a
handful of contributions summed in another order, in the row's dtype. Its id says every value
that is not the dimension's default, e.g.
``dist_autograd/pairs/chain/w3/fp32/call-async+structure-nested+passes-3``. `project(scenario)`
reads a hand-written scenario as a row where its composition is one the generator builds the
same way (same topology, call, structures, use ...), so the pinned catalogue counts towards
coverage; the others (sparse, TorchScript, hooks ...) lie outside the space.
"""

from __future__ import annotations

from conformance.catalogue.dist_autograd import EVERY
from conformance.models.dist_autograd_composed import COMPOSED
from conformance.space.dist_autograd import DIMENSIONS, FULL_VALUES
from conformance.spec import Scenario, float_tolerance

DEFAULTS = {d.name: d.values[0] for d in DIMENSIONS}
DTYPE = {"fp64": "float64", "fp32": "float32"}
HEAD = ("topology", "world", "dtype")

# hand-written kind -> the values it differs in from the defaults (None: outside the space)
HANDWRITTEN: dict[str, dict] = {
    "simple": {}, "chain": {"topology": "chain", "params": "remote"}, "fan-out": {"topology": "fan-out"},
    "sent-twice": {"topology": "sent-twice"}, "round-trip": {"topology": "round-trip", "params": "remote"},
    "multi-roots": {"topology": "fan-out", "roots": "several"}, "unused-leaf": {"unused": "leaf"},
    "unused-arg": {"unused": "arg"}, "unused-result": {"unused": "result"}, "structures": {"structure": "nested"},
    "async": {"topology": "fan-out", "call": "async"}, "remote-error": {"topology": "chain", "error": "remote"},
    "async-single": {"call": "async"}, "retain-graph-simple": {"passes": 3},
    "async-structures": {"call": "async", "structure": "nested"},
    "retain-graph-structures": {"structure": "nested", "passes": 3},
    "chain-structures": {"topology": "chain", "params": "remote", "structure": "nested"},
    "rref-to-here": {"call": "rref"},
}


def _word(value) -> str:
    return str(value)


def scenario_id(row: dict, tag: str) -> str:
    head = f"dist_autograd/{tag}/{row['topology']}/w{row['world']}/{row['dtype']}"
    rest = [f"{k}-{_word(v)}" for k, v in row.items() if k not in HEAD and v != DEFAULTS[k]]
    return head + ("/" + "+".join(rest) if rest else "")


def clauses(row: dict) -> tuple[str, ...]:
    """The contract's clauses the row exercises (docs/contracts/dist_autograd.md)."""
    on = set(EVERY)
    on |= {"A2"} if row["topology"] in ("fan-out", "sent-twice") or row["passes"] > 1 else set()
    on |= {"A4"} if row["unused"] != "none" else set()
    on |= {"A5"} if row["passes"] > 1 else set()
    on |= {"A6"} if row["roots"] == "several" else set()
    on |= {"A8"} if row["error"] != "none" else set()
    on |= {"A9"} if row["structure"] == "nested" else set()
    on |= {"A10"} if row["call"] == "async" else set()
    on |= {"A11"} if row["topology"] in ("chain", "round-trip") or row["params"] == "remote" else set()
    on |= {"A12"} if row["call"] == "rref" else set()
    return tuple(sorted(on, key=lambda c: int(c[1:])))


def scenario(row: dict, profiles: frozenset, tag: str = "pairs") -> Scenario:
    """The scenario one row of the covering array describes."""
    dtype = DTYPE[row["dtype"]]
    return Scenario(
        id=scenario_id(row, tag), area="dist_autograd", model=COMPOSED, model_kwargs=tuple(row.items()),
        dtype=dtype, world_size=row["world"], steps=1, optimizer="none",
        tolerance=float_tolerance(dtype, 8, f"{dtype}: gradient contributions accumulated in another order than "
                                             "local autograd"),
        exact_data=False, buffer_rule="none", profiles=profiles, clauses=clauses(row),
        timeout_s=15.0 if row["unused"] in ("arg", "result") else 30.0,  # as the pinned unused-arg/-result: an
        # engine that waits for a gradient of every send function hangs (torch: until its 60 s RPC timeout)
        description="generated: " + ", ".join(f"{k}={v}" for k, v in row.items() if v != DEFAULTS[k]),
    )


def project(s: Scenario) -> dict | None:
    """A dist_autograd scenario as a row of the space; None where it is outside it."""
    if s.area != "dist_autograd":
        return None
    if s.model == COMPOSED:
        return dict(s.model_kwargs)
    if s.model not in HANDWRITTEN or s.model_kwargs:
        return None
    row = {**DEFAULTS, **HANDWRITTEN[s.model], "world": s.world_size}
    allowed = {d.name: d.values for d in DIMENSIONS} | FULL_VALUES
    return row if all(row[k] in allowed[k] for k in allowed) else None
