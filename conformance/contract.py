"""Checks the data-parallel contract: every rank's record against the oracle, in order.

Order matters: the first point where an implementation diverges is reported, because a
wrong first step can be hidden (or amplified) by later ones. For every event we check
(1) each rank against the oracle, then (2) every rank bitwise against rank 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from conformance.baseline import Baseline
from conformance.compare import EXACT_ACROSS_RANKS, ConformanceError, compare_dicts, failure_message
from conformance.semantics import TORCH_DDP, Buffers, Semantics
from conformance.spec import Expect, Scenario

_BUFFER_RULES = {
    Buffers.BEFORE_FORWARD: "rank 0's buffers are broadcast before each forward",
    Buffers.NEVER: "declared: buffers are never synchronized, each rank keeps its own",
    Buffers.CONSTRUCTION_ONLY: "declared: rank 0's buffers at construction, then each rank its own",
    Buffers.AFTER_BACKWARD: "declared: rank 0's buffers are broadcast after each synced backward",
}


@dataclass
class Checked:
    """What a passing run showed (goes into the report)."""

    comparisons: int
    accepted_error: str | None = None
    details: dict = field(default_factory=dict)  # timings, backward stats: for the report


def repro_command(scenario: Scenario, adapter: str) -> str:
    adapter_arg = f"--ddp-class {adapter.split('=', 1)[1]}" if adapter.startswith("ddp-class=") else f"--adapter {adapter}"
    device = f" --device {scenario.device}" if scenario.device != "cpu" else ""
    return f"gradparity run {adapter_arg} --scenario {scenario.id}{device}"


def check_records(
    scenario: Scenario, adapter: str, baseline: Baseline, records: dict[int, dict], *, semantics: Semantics = TORCH_DDP,
) -> Checked:
    """Raise ConformanceError at the first violation; return a summary otherwise.

    `baseline` must have been computed under the same declared `semantics`; a declared lossy
    bound replaces the scenario's tolerance against the oracle (ranks stay bitwise).
    """
    tol = semantics.lossy or scenario.tolerance
    buffer_rule = _BUFFER_RULES[semantics.buffers]
    repro = repro_command(scenario, adapter)
    count = 0

    def fail(rank, where, what, mismatches, tolerance=tol):
        raise ConformanceError(
            failure_message(
                scenario_id=scenario.id, adapter=adapter, rank=rank, where=where, what=what,
                mismatches=mismatches, tol=tolerance, repro=repro,
            )
        )

    missing = [r for r in range(scenario.world_size) if r not in records]
    if missing:
        raise ConformanceError(f"[{scenario.id}] adapter {adapter}: no result from rank(s) {missing}")

    # 1. Construction: rank 0's parameters and buffers everywhere (or, where a declared rule
    #    defers the sync, each rank's own).
    for rank in range(scenario.world_size):
        init = records[rank]["init"]
        params, buffers = baseline.init_for(rank)
        for kind, expected, own in (("parameters", params, baseline.init_params_ranks),
                                    ("buffers", buffers, baseline.init_buffers_ranks)):
            bad = compare_dicts(expected, init[kind], EXACT_ACROSS_RANKS)
            count += 1
            if bad:
                why = (f"{kind} differ from this rank's own initial {kind} (declared: {semantics.describe()})" if own
                       else f"{kind} differ from rank 0's initial {kind} (construction-time broadcast)")
                fail(rank, "after construction", why, bad, EXACT_ACROSS_RANKS)

    # 2. Events, in training order.
    errors = {r: rec.get("error") for r, rec in records.items()}
    lengths = {r: len(rec["events"]) for r, rec in records.items()}
    for index, expected in enumerate(baseline.events):
        present = [r for r in range(scenario.world_size) if index < lengths[r]]
        if len(present) < scenario.world_size:
            if scenario.expect in (Expect.MATCH_OR_ERROR, Expect.ERROR) and all(errors.values()) and not present:
                break
            absent = sorted(set(range(scenario.world_size)) - set(present))
            why = "; ".join(f"rank {r}: {errors[r]['type']}: {errors[r]['message']}" for r in absent if errors.get(r))
            raise ConformanceError(
                f"[{scenario.id}] adapter {adapter}: rank(s) {absent} stopped before {expected.where()}"
                + (f" ({why})" if why else "") + (f"\n  repro: {repro}")
            )
        for rank in present:
            actual = records[rank]["events"][index]
            if (actual["kind"], actual["step"]) != (expected.kind, expected.step):
                raise ConformanceError(f"[{scenario.id}] rank {rank}: record out of order at {expected.where()}")
            if expected.per_rank[rank] is None:
                continue  # this rank takes no part here (join: it ran out of data)
            what = "gradients differ from the oracle" if expected.kind == "backward" else "parameters differ from the oracle"
            bad = compare_dicts(expected.per_rank[rank], actual["values"], tol)
            count += 1
            if bad:
                fail(rank, expected.where(), what, bad)
            wanted = expected.buffers[rank] if expected.buffers else None
            if wanted is not None and scenario.buffer_rule == "rank0-broadcast":
                bad = compare_dicts(wanted, actual["buffers"], tol)
                if bad:
                    fail(rank, expected.where(), f"buffers differ from the oracle (rule: {buffer_rule})", bad)
        taking_part = [r for r in present if expected.per_rank[r] is not None]
        if expected.synced and taking_part:
            reference = records[taking_part[0]]["events"][index]["values"]
            for rank in taking_part[1:]:
                bad = compare_dicts(reference, records[rank]["events"][index]["values"], EXACT_ACROSS_RANKS)
                count += 1
                if bad:
                    fail(rank, expected.where(), "not bitwise identical to rank 0", bad, EXACT_ACROSS_RANKS)

    # 3. Errors: accepted only where the scenario allows them, on every rank, matching.
    raised = {r: e for r, e in errors.items() if e}
    if scenario.expect == Expect.ERROR and len(raised) != scenario.world_size:
        quiet = sorted(set(range(scenario.world_size)) - set(raised))
        raise ConformanceError(
            f"[{scenario.id}] adapter {adapter}: rank(s) {quiet} did not raise; every rank must raise an error "
            f"matching {scenario.error_pattern!r} ({scenario.description or 'see the scenario'})\n  repro: {repro}"
        )
    if raised:
        pattern = scenario.error_pattern
        if scenario.expect not in (Expect.MATCH_OR_ERROR, Expect.ERROR) or len(raised) != scenario.world_size:
            first = next(iter(raised.values()))
            raise ConformanceError(f"[{scenario.id}] unexpected error on rank(s) {sorted(raised)}: {first['message']}")
        for r, e in raised.items():
            if not re.search(pattern, e["message"]):
                raise ConformanceError(f"[{scenario.id}] rank {r} raised an error that does not match {pattern!r}: {e['message']}")
        first = raised[0]
        return Checked(count, accepted_error=f"{first['type']} at step {first['step']}: {first['message'].splitlines()[0][:200]}")
    return Checked(count)
