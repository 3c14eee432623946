"""A row of the data_parallel scenario space (`conformance.space.data_parallel`) as a `Scenario`, and back.

`scenario(row)` builds what the area's runner drives (`conformance.runners.data_parallel`), with
the hand-written catalogue's rules (`conformance.catalogue.data_parallel`): exact with
small-integer data where every sum is exact in any order, else replayed replica by replica
(bitwise at 1-2 replicas, a summation order at 3-4) with the full-batch band straight through,
and autocast's replayed rule. Its id says every value that is not the dimension's default, e.g.
``data_parallel/pairs/nested-io/r3/fp32/batch-uneven+autocast-bf16+input_grad-on``.
`project(scenario)` reads a hand-written scenario as a row, so the pinned catalogue counts
towards coverage.
"""

from __future__ import annotations

from dataclasses import replace

from conformance.catalogue.data_parallel_scenario import (
    EXACT_SUMS,
    INEXACT_MODELS,
    autocast_rule,
    make,
    replica_rule,
)
from conformance.space.data_parallel import DIMENSIONS, FULL_VALUES
from conformance.spec import Scenario, float_tolerance

DEFAULTS = {d.name: d.values[0] for d in DIMENSIONS}
DTYPE = {"fp32": "float32", "fp64": "float64"}
SHORT = {"optimizer": "opt", "grad_mode": "grad", "mode_switch": "mode"}
SWITCHES = {"no-grad-last": "no_grad", "no-grad-first": "no_grad_first"}


def rows_of(batch: str, replicas: int) -> int:
    """The full batch's rows for a `batch` value (`conformance.space.data_parallel`, dimension batch)."""
    return {"even": 4 * replicas, "uneven": 2 * replicas + 1, "fewer": replicas - 1, "one-row": 1}[batch]


def _word(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _id(row: dict, tag: str) -> str:
    head = f"data_parallel/{tag}/{row['model']}/r{row['replicas']}/{row['dtype']}"
    rest = [f"{SHORT.get(k, k)}-{_word(v)}" for k, v in row.items()
            if k not in ("model", "replicas", "dtype") and v != DEFAULTS[k]]
    return head + ("/" + "+".join(rest) if rest else "")


def _tolerance(row: dict, rows: int):
    w, dtype = row["replicas"], DTYPE[row["dtype"]]
    if row["autocast"] != "off":
        return autocast_rule(w)
    if row["data"] == "int" and row["optimizer"] == "none" and row["model"] not in INEXACT_MODELS:
        return EXACT_SUMS
    band = float_tolerance(dtype, rows, f"{dtype}: batch sums over {rows} rows in another split, compounding over steps")
    return replica_rule(dtype, w, band)


def scenario(row: dict, profiles: frozenset, tag: str = "pairs") -> Scenario:
    """The scenario one row of the covering array describes."""
    w, rows = row["replicas"], rows_of(row["batch"], row["replicas"])
    switches = {}
    if row["grad_mode"] in SWITCHES:
        switches[SWITCHES[row["grad_mode"]]] = True
    for on, name in ((row["input_grad"], "input_grad"), (row["autocast"] != "off", "autocast"),
                     (row["mode_switch"] == "eval-last", "eval_last")):
        if on:
            switches[name] = True
    s = make("pairs", row["model"], w=w, batch=rows, profiles=profiles, dtype=DTYPE[row["dtype"]],
             steps=2 if row["optimizer"] == "none" else 3, optimizer=row["optimizer"], switches=switches,
             tolerance=_tolerance(row, rows), exact_data=row["data"] == "int",
             description="generated: " + ", ".join(f"{k}={v}" for k, v in row.items() if v != DEFAULTS[k]))
    return replace(s, id=_id(row, tag))


def project(s: Scenario) -> dict | None:
    """A hand-written data_parallel scenario as a row of the space; None where a value is outside it."""
    if s.area != "data_parallel":
        return None
    kw = s.kwargs()
    w, rows = s.world_size, sum(s.shard_sizes)
    batch = ("one-row" if rows == 1 else "fewer" if rows < w else "uneven" if rows % w else "even")
    grad = "no-grad-last" if kw.get("no_grad") else "no-grad-first" if kw.get("no_grad_first") else "on"
    row = {
        "model": s.model, "replicas": w, "batch": batch,
        "dtype": {"float32": "fp32", "float64": "fp64"}.get(s.dtype),
        "data": "int" if s.exact_data else "cont", "optimizer": s.optimizer, "grad_mode": grad,
        "input_grad": bool(kw.get("input_grad")), "autocast": "bf16" if kw.get("autocast") else "off",
        "mode_switch": "eval-last" if kw.get("eval_last") else "off",
    }
    if set(kw) - {"no_grad", "no_grad_first", "input_grad", "autocast", "eval_last"}:
        return None
    allowed = {d.name: d.values for d in DIMENSIONS} | {"model": FULL_VALUES["model"]}
    return row if all(row[k] in allowed[k] for k in allowed) else None
