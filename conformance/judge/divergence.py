"""Where a failing case left its rule, at a glance: every (event × tensor) against the oracle.

The contract stops at the first violation (`conformance.judge.contract`); a person wants more:
which layers went wrong, from which step, and how far. For a failing case this map compares
every recorded event of one rank (each backward: the gradients; each optimizer step: the
parameters) with the re-anchored oracle under the case's own rule, tensor by tensor, and keeps
one number per cell: how far the worst element lies outside the rule, in ulps of the tensor's
dtype at the expected value (0: within the rule; -1: a structural mismatch, e.g. a gradient
where None was expected). Re-anchored, each step is judged from the engine's own state, so a
column shows that step's own error, not one carried over from earlier steps.

The HTML report draws it per module (`conformance.report.divergence_html`), so a 100-tensor model
reads as a few dozen rows: "layer 5's expert weights, from step 2".
"""

from __future__ import annotations

import math

from conformance.judge.compare import compare_tensor
from conformance.spec import Tolerance

STRUCTURAL = -1.0  # None vs a tensor, a dtype or shape mismatch: no distance to speak of
CAP = 1e30  # an infinite or NaN distance, kept JSON-friendly


def _cell(name: str, expected, actual, tol: Tolerance) -> float:
    m = compare_tensor(name, expected, actual, tol)
    if m is None:
        return 0.0
    if m.outside_ulps is None:
        return STRUCTURAL
    value = float(m.outside_ulps)
    return CAP if math.isnan(value) or value > CAP else max(value, 0.0)


def label(kind: str, step: int, micro: int, synced: bool) -> str:
    if kind == "step":
        return f"s{step} params"
    return f"s{step} m{micro}" + ("" if synced else " (no_sync)")


def divergence_map(baseline, records: dict[int, dict], tol: Tolerance, step_tol: Tolerance, rank: int = 0) -> dict:
    """{events, tensors, cells[event][tensor], first, unit, rule} for one rank's record."""
    events = (records.get(rank) or {}).get("events") or []
    tensors = list(baseline.init_params)
    labels, cells, first = [], [], None
    for index, expected in enumerate(baseline.events):
        if index >= len(events) or expected.kind not in ("backward", "step") or expected.per_rank[rank] is None:
            continue
        actual = events[index]
        values = actual.get("values")
        if values is None:
            continue
        this_tol = tol if expected.kind == "backward" else step_tol
        row = [_cell(n, expected.per_rank[rank].get(n), values.get(n), this_tol) for n in tensors]
        labels.append(label(expected.kind, expected.step, expected.micro, expected.synced))
        cells.append(row)
        if first is None:
            bad = next((n for n, v in zip(tensors, row, strict=True) if v != 0.0), None)
            if bad is not None:
                first = {"event": len(labels) - 1, "tensor": bad}
    return {"rank": rank, "unit": "ulps outside the rule", "rule": tol.describe(), "events": labels,
            "tensors": tensors, "cells": cells, "first": first}
