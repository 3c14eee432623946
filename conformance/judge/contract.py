"""Checks the data-parallel contract: every rank's record against the oracle, in order.

Order matters: the first point where an implementation diverges is reported, because a
wrong first step can be hidden (or amplified) by later ones. For every event we check
(1) each rank against the oracle, then (2) every rank bitwise against rank 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from conformance.judge.compare import (
    EXACT_ACROSS_RANKS,
    ConformanceError,
    compare_dicts,
    failure_message,
    placements_matched,
)
from conformance.judge.failure import RanksRaised, first_line
from conformance.oracle import buffers, trajectory
from conformance.oracle.baseline import Baseline
from conformance.oracle.envelope import Envelope, rule_of
from conformance.semantics import TORCH_DDP, Semantics
from conformance.spec import Expect, Scenario, Tolerance

# Re-anchored, the expected parameters after a step are the same optimizer's on the engine's own
# (already judged) gradients and parameters: the same elementwise kernels, so bitwise.
EXACT_AFTER_STEP = Tolerance(True, reason="re-anchored: the same optimizer on the engine's own judged gradients")
# The straight-through check at 3+ ranks ([Note: the accumulated envelope] in conformance.oracle.trajectory).
ACCUMULATED = Tolerance(True, rule=trajectory.RULE, reason="straight through: every earlier step's verified order "
                        "choices carried through the reference step, plus this step's envelope")

@dataclass
class Checked:
    """What a passing run showed (goes into the report)."""

    comparisons: int
    accepted_error: str | None = None
    details: dict = field(default_factory=dict)  # timings, backward stats: for the report
    # What the oracle accepted for each judged tensor, by the recording's key (point, step, micro,
    # kind, name, rank): a tensor (bitwise) or an Envelope. Kept for `--record` (conformance.recording),
    # so `compare --tolerance oracle` judges a moved tensor by its case's and step's own rule.
    expected: dict | None = field(default=None, repr=False)


def repro_command(scenario: Scenario, adapter: str) -> str:
    adapter_arg = f"--ddp-class {adapter.split('=', 1)[1]}" if adapter.startswith("ddp-class=") else f"--adapter {adapter}"
    device = f" --device {scenario.device}" if scenario.device != "cpu" else ""
    return f"gradparity run {adapter_arg} --scenario {scenario.id}{device}"


def check_records(
    scenario: Scenario, adapter: str, baseline: Baseline, records: dict[int, dict], *, semantics: Semantics = TORCH_DDP,
    straight_through: Baseline | None = None,
) -> Checked:
    """Raise ConformanceError at the first violation; return a summary otherwise.

    `baseline` must have been computed under the same declared `semantics`; a declared lossy
    rule replaces the scenario's tolerance against the oracle (ranks stay bitwise). With a
    `straight_through` oracle, `baseline` is the re-anchored one (`baseline.compute_anchored`):
    every step is judged from the engine's own state, so parameters after a step and buffers are
    bitwise (the same optimizer on the engine's judged gradients), and the straight-through
    oracle is a second check under the rule's `straight_through` band, reported in
    `details["oracle"]` and failing only beyond that band.
    """
    tol = rule_of(scenario, semantics)
    anchored = straight_through is not None
    # Re-anchored, a step's parameters and the buffers come from the same kernels on the same inputs.
    exact_state = EXACT_AFTER_STEP if anchored else tol
    buffer_tol = tol if tol.kind == "band" else exact_state
    repro = repro_command(scenario, adapter)

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

    count = _judge_construction(scenario, baseline, records, semantics, fail)
    # 2. Events, in training order.
    errors = {r: rec.get("error") for r, rec in records.items()}
    placements, judged = [], {}  # which placements of 1/W explain each judged event; what the oracle accepted
    count += _judge_events(scenario, adapter, baseline, records, errors, repro, fail, tol, exact_state, buffer_tol,
                           semantics, across_ranks=True, placements=placements, judged=judged)
    details = {"oracle": _oracle_summary(baseline, tol, anchored) | _placement_matched(tol, placements)}
    if anchored:
        said = details["oracle"]["straight_through"] = _judge_straight_through(
            scenario, adapter, straight_through, records, errors, repro, fail, tol, semantics, baseline)
        if said.startswith(f"within {ACCUMULATED.describe()}"):  # the rule the report names is the one applied
            details["oracle"]["rule"] = replace(tol, straight_through=ACCUMULATED).describe()
    return _judge_errors(scenario, adapter, errors, repro, count, details, judged)


def _judge_construction(scenario: Scenario, baseline: Baseline, records: dict[int, dict], semantics: Semantics,
                        fail) -> int:
    """1. Construction: rank 0's parameters and buffers everywhere (or, where a declared rule
    defers the sync, each rank's own)."""
    count = 0
    for rank in range(scenario.world_size):
        init = records[rank]["init"]
        params, buffers = baseline.init_for(rank)
        for kind, expected, own in (("parameters", params, baseline.init_params_ranks),
                                    ("buffers", buffers, baseline.init_buffers_ranks)):
            bad = compare_dicts(expected, init[kind], EXACT_ACROSS_RANKS)
            count += 1
            if bad:
                why = (f"{kind} differ from this rank's own initial {kind} ({_deferred(scenario, semantics, kind)})" if own
                       else f"{kind} differ from rank 0's initial {kind} (construction-time broadcast)")
                fail(rank, "after construction", why, bad, EXACT_ACROSS_RANKS)
    return count


def _deferred(scenario: Scenario, semantics: Semantics, kind: str) -> str:
    """Why a rank keeps its own initial parameters or buffers: the declaration, or for buffers
    torch DDP's own rule with ``broadcast_buffers=False`` (`conformance.oracle.buffers`)."""
    if kind == "buffers" and buffers.rule(scenario, semantics) != semantics.buffers:
        return buffers.describe(scenario, semantics)
    return f"declared: {semantics.describe()}"


def _judge_straight_through(scenario, adapter, straight_through, records, errors, repro, fail, tol,
                            semantics, anchored: Baseline) -> str:
    """2b. The straight-through oracle: the second check (rounding compounds there). Judged by the
    accumulated envelope where the re-anchored oracle replayed every step per summation order
    (`conformance.oracle.trajectory`), else by the rule's straight-through band. Returns what the
    report says of it; raises outside it."""
    band = tol.straight_through or (tol if tol.kind in ("band", "norm") else None)
    if band is None:
        return "implied: every step bitwise from the engine's own state"
    if scenario.steps == 1 and not dict(scenario.features).get("join") and tol.kind == "derived-bound":
        # One step: both oracles start from construction (the re-anchored one from the engine's
        # recorded state, verified bitwise equal to it), so they are the same replay, already judged
        # by the derived rule; the band, narrower than a derived bound where shares cancel, would
        # only judge the same values by a rule that is not theirs.
        return "implied: one step, from the construction state both oracles start from"
    envelope = trajectory.accumulated(anchored, straight_through) if band.kind == "band" and tol.exact else None
    if envelope is not None:
        straight_through, band = envelope, ACCUMULATED
    try:
        _judge_events(scenario, adapter, straight_through, records, errors, repro,
                      lambda *a: fail(*a[:4], band), band, band, band, semantics, across_ranks=False)
    except ConformanceError as exc:
        raise ConformanceError(f"straight-through check (the oracle trained from the seeds, "
                               f"every step re-anchored check passed): {exc}") from None
    return f"within {band.describe()}"


def _judge_errors(scenario: Scenario, adapter: str, errors: dict, repro: str, count: int, details: dict,
                  judged: dict | None = None) -> Checked:
    """3. Errors: accepted only where the scenario allows them, on every rank, matching."""
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
        return Checked(count, accepted_error=f"{first['type']} at step {first['step']}: {first['message'].splitlines()[0][:200]}",
                       details=details, expected=judged)
    return Checked(count, details=details, expected=judged)


def _placement_first(what: str, bad: list, tol) -> str:
    """The failure's first line: where every failing tensor matches another exact placement of 1/W
    than the declared one, say so (the declaration is wrong, not the average)."""
    others = {p for m in bad for p in m.other_placements}
    if not others or not all(m.other_placements for m in bad):
        return what
    return (f"{what}: they match 1/W placed {'/'.join(sorted(others))}, not the declared {'/'.join(tol.divide)} "
            "(declare it with gradparity_semantics, or in the adapter's Semantics.scaling)")


def _placement_matched(tol, placements: list[set[str]]) -> dict:
    """Where several placements of 1/W are accepted, which one explains every judged gradient (for the report)."""
    if len(tol.divide) < 2 or not tol.exact:
        return {}
    common = set.intersection(*placements) if placements else set()
    matched = ("not distinguishable (every order and placement agreed)" if not placements else
               "none alone: some gradients only match pre, others only post" if not common else
               " and ".join(sorted(common)) + (" (indistinguishable here)" if len(common) > 1 else ""))
    return {"placement_matched": matched}


def _judge_events(scenario, adapter, baseline, records, errors, repro, fail, tol, step_tol, buffer_tol, semantics,
                  *, across_ranks: bool, placements: list | None = None, judged: dict | None = None) -> int:
    """Every expected event in training order, each rank against the oracle (and rank 0)."""
    count = 0
    buffer_rule = buffers.describe(scenario, semantics)
    lengths = {r: len(rec["events"]) for r, rec in records.items()}
    for index, expected in enumerate(baseline.events):
        present = [r for r in range(scenario.world_size) if index < lengths[r]]
        if len(present) < scenario.world_size:
            if scenario.expect in (Expect.MATCH_OR_ERROR, Expect.ERROR) and all(errors.values()) and not present:
                break
            absent = sorted(set(range(scenario.world_size)) - set(present))
            raisers = [r for r in absent if errors.get(r)]
            why = "; ".join(f"rank {r}: {errors[r]['type']}: {errors[r]['message']}" for r in raisers)
            message = (f"[{scenario.id}] adapter {adapter}: rank(s) {absent} produced no record for {expected.where()}"
                       + (f" ({why})" if why else "") + f"\n  repro: {repro}")
            if raisers:  # the implementation raised there: class `raised`, not a wrong value
                first = errors[raisers[0]]
                raise RanksRaised(message, f"rank {raisers[0]} raised {first['type']}: {first_line(first['message'])}")
            raise ConformanceError(message)
        broken = baseline.rng_break
        if across_ranks and broken and expected.kind == "backward" and (expected.step, expected.micro) == broken[1:3]:
            raise ConformanceError(f"[{scenario.id}] adapter {adapter}: {broken[3]}\n  repro: {repro}")
        for rank in present:
            actual = records[rank]["events"][index]
            if (actual["kind"], actual["step"]) != (expected.kind, expected.step):
                raise ConformanceError(f"[{scenario.id}] rank {rank}: record out of order at {expected.where()}")
            if expected.per_rank[rank] is None:
                continue  # this rank takes no part here (join: it ran out of data)
            backward = expected.kind == "backward"
            what = "gradients differ from the oracle" if backward else "parameters differ from the oracle"
            this_tol = tol if backward else step_tol
            bad = compare_dicts(expected.per_rank[rank], actual["values"], this_tol)
            count += 1
            if bad:
                fail(rank, expected.where(), _placement_first(what, bad, this_tol), bad, this_tol)
            if judged is not None and this_tol.exact:  # what the exact rule accepted; a band is the rule itself
                point, kind = (actual["kind"], actual.get("step"), actual.get("micro")), "grad" if backward else "param"
                judged.update({(*point, kind, name, rank): v for name, v in expected.per_rank[rank].items()})
            if backward and placements is not None:
                matched = placements_matched(expected.per_rank[rank], actual["values"])
                if matched is not None:
                    placements.append(matched)
            wanted = expected.buffers[rank] if expected.buffers else None
            if wanted is not None and scenario.buffer_rule == "rank0-broadcast":
                bad = compare_dicts(wanted, actual["buffers"], buffer_tol)
                if bad:
                    fail(rank, expected.where(), f"buffers differ from the oracle (rule: {buffer_rule})", bad, buffer_tol)
                if judged is not None and buffer_tol.exact:  # a band is the recording's own rule (no value needed)
                    point = (actual["kind"], actual.get("step"), actual.get("micro"))
                    judged.update({(*point, "buffer", name, rank): v for name, v in wanted.items()})
        taking_part = [r for r in present if expected.per_rank[r] is not None]
        if across_ranks and expected.synced and taking_part:
            reference = records[taking_part[0]]["events"][index]["values"]
            for rank in taking_part[1:]:
                bad = compare_dicts(reference, records[rank]["events"][index]["values"], EXACT_ACROSS_RANKS)
                count += 1
                if bad:
                    fail(rank, expected.where(), "not bitwise identical to rank 0", bad, EXACT_ACROSS_RANKS)
    return count


def _oracle_summary(baseline: Baseline, tol: Tolerance, anchored: bool) -> dict:
    """Which rule judged the case, and the widest envelope it used (for the report)."""
    widest_abs = widest_u = 0.0
    envelopes = 0
    for event in baseline.events:
        for values in event.per_rank:
            for v in (values or {}).values():
                if isinstance(v, Envelope):
                    envelopes += 1
                    a, u = v.spread()
                    widest_abs, widest_u = max(widest_abs, a), max(widest_u, u)
            break  # every rank expects the same envelope objects after a synced backward
    return {"rule": tol.describe(), "kind": tol.kind, "reason": tol.reason,
            "steps": "re-anchored on the engine's state" if anchored else "straight through",
            "envelopes": envelopes, "largest_bound_abs": widest_abs, "largest_bound_u": widest_u}
