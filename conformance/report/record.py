"""One case's result as the reports store it (shared by the pytest plugin and torchrun)."""

from __future__ import annotations

from conformance.case import CASE_SEPARATOR, case_id
from conformance.spec import Scenario

# The message of a pass of a case listed as a known-intermittent failure (`intermittent:` entries).
INTERMITTENT_PASS = "passed this run; listed as a known intermittent failure, either outcome is accepted"


def case_record(adapter_spec: str, scenario: Scenario, *, verdict: str, message: str, duration_s: float, checked=None,
                failure=None, xfail_reason: str = "") -> dict:
    """`failure` is a `conformance.judge.failure.Classified` for every non-pass (None for a pass or skip):
    the record then carries `failure_class` (wrong value, raised, crashed, hung, infrastructure)
    and a one-line `cause`.

    `message` is always what was seen (the failure's text; a skip's reason); for an expected
    failure (xfailed, or a strict xfail that passed) `xfail_reason` says why it is expected, so a
    case that starts failing differently than listed is visible in the report; a pass of a case
    listed as `intermittent:` keeps it too (`intermittent_outcome`)."""
    return {
        "case": case_id(adapter_spec, scenario),
        "adapter": adapter_spec,
        "scenario": scenario.id,
        "area": scenario.area,
        "world_size": scenario.world_size,
        "device": scenario.device,
        "dtype": scenario.dtype,
        "options": scenario.options.describe(),
        "profiles": sorted(scenario.profiles),
        # The rule the oracle applied: the scenario's, or the adapter's declared one (conformance.oracle.envelope.rule_of).
        **applied_rule(adapter_spec, scenario),
        "seed": scenario.seed,
        "upstream": scenario.upstream,
        "clauses": list(scenario.clauses),
        "description": scenario.description,
        "verdict": verdict,
        "message": message,
        "xfail_reason": xfail_reason,
        "failure_class": failure.failure_class.value if failure is not None else None,
        "cause": failure.cause if failure is not None else "",
        "duration_s": round(duration_s, 4),
        "comparisons": getattr(checked, "comparisons", None),
        "accepted_error": getattr(checked, "accepted_error", None),
        "details": getattr(checked, "details", None) or {},
        "declared": declared_deviations(adapter_spec, scenario),
    }


def declared_deviations(adapter_spec: str, scenario: Scenario) -> list[str]:
    """The adapter's declared deviations from torch DDP's rules for this scenario (may be [])."""
    from conformance.adapters import registry
    from conformance.semantics import declared

    try:
        return declared(registry.load(adapter_spec), scenario).deviations()
    except Exception as exc:  # a report is still written; the case itself shows the error
        return [f"(could not read the declared semantics: {exc})"]


def one_line(record: dict) -> str:
    """`[class] cause` for a classified failure, else the message's first line."""
    if record.get("failure_class"):
        return f"[{record['failure_class']}] {record.get('cause') or ''}".rstrip()
    first = (record.get("message") or "").strip().splitlines()[:1]
    return first[0] if first else record["verdict"]


def intermittent_outcome(record: dict) -> str:
    """For a case whose expected-failure entry is marked `intermittent:`, what happened this run
    ("the listed failure did not happen: passed" / "the listed failure happened: xfailed"); "" for
    every other case. The front ends print it, so neither outcome of such a case is silent."""
    from conformance.expectations import intermittent

    if not intermittent(record.get("xfail_reason")):
        return ""
    if record.get("verdict") == "passed":
        return "known intermittent failure did not happen this run: passed (every value judged right)"
    if record.get("verdict") == "xfailed":
        return f"known intermittent failure happened this run: xfailed ({one_line(record)})"
    return ""


def lost_case_record(nodeid: str, text: str, known: set[str] = frozenset()) -> dict | None:
    """The record of a suite case whose pytest report carries none — the process running it died
    (an xdist worker crash) — as an infrastructure `error` with pytest's line as its cause; None
    for a node that is not a suite case, or a case already recorded (a teardown failure)."""
    from conformance.judge.failure import Classified, FailureClass, first_line

    param = nodeid.rpartition("[")[2].rstrip("]") if nodeid.endswith("]") else ""
    spec, sep, scenario_id = param.partition(CASE_SEPARATOR)
    if not sep or param in known:
        return None
    scenario = _scenario(scenario_id)
    if scenario is None:
        return None
    cause = f"no result: the process running this case died ({first_line(text) or 'no report'})"
    return case_record(spec, scenario, verdict="error", message=text, duration_s=0.0,
                       failure=Classified(FailureClass.INFRASTRUCTURE, cause))


def _scenario(scenario_id: str) -> Scenario | None:
    """The catalogue scenario a case id names, on its device: a run on another device than the
    catalogue's (`--device cuda`) names its cases `<id>/<device>` (`catalogue.on_device`)."""
    from conformance import catalogue

    by_id = {s.id: s for s in catalogue.all_scenarios()}
    if scenario_id in by_id:
        return by_id[scenario_id]
    base, _, device = scenario_id.rpartition("/")
    if base in by_id and device in ("cpu", "cuda"):  # the --device choices (conformance/frontends/options.py)
        return catalogue.on_device(by_id[base], device)
    return None


def applied_rule(adapter_spec: str, scenario: Scenario) -> dict:
    """tolerance (its description), tolerance_kind (bitwise | summation-order | derived-bound | band |
    norm) and tolerance_reason of the rule this adapter's case is judged by."""
    from conformance.oracle.envelope import rule_of

    rule = scenario.tolerance
    try:
        from conformance.adapters import registry
        from conformance.semantics import declared

        rule = rule_of(scenario, declared(registry.load(adapter_spec), scenario))
    except Exception:  # noqa: BLE001 - an adapter that cannot load: the scenario's rule (the case shows the error)
        pass
    return {"tolerance": rule.describe(), "tolerance_kind": rule.kind, "tolerance_reason": rule.reason}
