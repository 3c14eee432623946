"""One case, every front end: run → judge → classify → a `CaseResult`.

`gradparity run` (the pytest plugin), `gradparity zoo` and the torchrun launcher all run a case
with `run_case(case, executor)`; they differ only in the executor (a warm rank pool here, the
torchrun world in `conformance.frontends.torchrun`) and in what they print. Planning — which
cases, which are skipped or expected to fail — is `conformance.plan`'s job; this module never
decides *what* to run, only how one case's outcome becomes a verdict.

The steps, for a case `(scenario, adapter)` of area A:
1. run A's task: on every rank of a world of the scenario's size (the executor), or in this
   process for a single-process area;
2. a rank that raised, died or gave no answer fails the case (`failure.run_failed`): a crash,
   hang or missing rank is never a pass;
3. otherwise A's judge compares the ranks' records with A's oracle;
4. whatever ended the case is classified (`conformance.judge.failure`): one class, one-line cause;
5. an expected failure (the plan's xfail) that failed is `xfailed` and keeps the error it
   actually showed; one that passed is `xpassed` (strict: the list must stay true), unless its
   reason is marked `intermittent:` (`conformance.expectations`): then it is `passed`, its
   record keeps the reason and says the listed failure did not happen this run;
6. with a `recorder` (`--record DIR`), every tensor the case produced is recorded here, where
   the `CaseResult` is made, whatever the verdict (`conformance.recording`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from conformance import cuda_setup
from conformance.area import Area
from conformance.case import Case
from conformance.expectations import intermittent
from conformance.harness.pool import TaskOutcome
from conformance.judge.contract import Checked, repro_command
from conformance.judge.failure import Classified, FailureClass, classify_exception, run_failed
from conformance.recording import Recorder
from conformance.report.record import INTERMITTENT_PASS, case_record
from conformance.runners.recording_tap import tapping
from conformance.spec import Scenario


@dataclass
class CaseResult:
    """What one case showed; `record()` is its one serialized form (reports, xdist, zoo.json)."""

    case: Case
    verdict: str  # passed | failed | error | skipped | xfailed | xpassed
    message: str = ""
    failure: Classified | None = None
    duration_s: float = 0.0
    checked: Checked | None = None
    details: dict = field(default_factory=dict)  # timings, backward stats, declarations: for the report
    records: int = 0  # how many ranks returned a record
    fired: int | None = None  # known-bad implementations: how often their bug took effect (summed)
    rank_raised: bool = False  # a rank's record holds an exception the implementation raised

    @property
    def scenario(self) -> Scenario:
        return self.case.scenario

    @property
    def adapter_spec(self) -> str:
        return self.case.adapter_spec

    def record(self) -> dict:
        # A listed case that passed is an xpass, or a pass of an `intermittent:` entry: both keep the reason.
        expected = self.case.xfail if self.verdict in ("xfailed", "xpassed", "passed") else None
        record = case_record(self.adapter_spec, self.scenario, verdict=self.verdict, message=self.message,
                             duration_s=self.duration_s, checked=self.checked, failure=self.failure,
                             xfail_reason=expected or "")
        record.update(details=self.details, records=self.records, fired=self.fired)
        return record


class Executor(Protocol):
    """Runs an area's task on every rank of a world: a warm pool, or the torchrun world."""

    def run(self, area: Area, scenario: Scenario, adapter_spec: str) -> TaskOutcome: ...

    def where(self, area: Area, scenario: Scenario) -> str: ...


class PoolExecutor:
    """Warm rank pools (one per topology), kept across cases; see `conformance.harness.pool`."""

    def __init__(self, pools=None, timeout_scale: float = 1.0):
        if pools is None:
            from conformance.harness.pool import PoolManager

            pools = PoolManager()
        self.pools, self.timeout_scale = pools, timeout_scale

    def run(self, area: Area, scenario: Scenario, adapter_spec: str) -> TaskOutcome:
        # An infrastructure failure is retried once on a fresh group inside `RankPool.run`.
        return self.pools.get(area.topology(scenario)).run(
            area.task_ref, (scenario, adapter_spec), timeout=scenario.timeout_s * self.timeout_scale,
            label=f"{scenario.id} with {adapter_spec}",
        )

    def where(self, area: Area, scenario: Scenario) -> str:
        return area.topology(scenario).key()

    def close(self) -> None:
        self.pools.close()


_IN_PROCESS = threading.Lock()  # single-process areas share this process's torch state


def _run(case: Case, executor: Executor) -> TaskOutcome:
    """Step 1. A single-process area runs (and, comparing as it goes, may raise) right here."""
    area, scenario, spec = case.area, case.scenario, case.adapter_spec
    if scenario.device == "cuda":  # this process computes the oracle (and in-process areas) on CUDA too
        cuda_setup.setup_process(backend=None)
    if not area.in_process:
        return executor.run(area, scenario, spec)
    with _IN_PROCESS:
        t0 = time.perf_counter()
        value = area.task((scenario, spec), None)
        return TaskOutcome(f"{scenario.id} with {spec}", values={0: value}, seconds=time.perf_counter() - t0)


def _judge(case: Case, outcome: TaskOutcome, executor: Executor) -> Checked:
    """Steps 2-3; raises at the first failure (the error says why)."""
    area, scenario, spec = case.area, case.scenario, case.adapter_spec
    if not outcome.ok:
        raise run_failed(scenario.id, spec, outcome, where=executor.where(area, scenario),
                         repro=repro_command(scenario, spec))
    return area.judge(scenario, spec, outcome.values)


def check(scenario: Scenario, adapter_spec: str, executor: Executor) -> Checked:
    """Run and judge one scenario; the error of the first failure propagates (for tests)."""
    case = Case(scenario, adapter_spec)
    return _judge(case, _run(case, executor), executor)


def run_case(case: Case, executor: Executor, recorder: Recorder | None = None) -> CaseResult:
    """Steps 1-6: never raises for the implementation's or the harness's failures."""
    if case.skip:
        return _recorded(recorder, CaseResult(case, "skipped", case.skip))
    t0 = time.perf_counter()
    outcome = checked = failure = taps = error = None
    message, fired_before = "", _in_process_fired(case)
    try:
        with tapping(recorder is not None) as taps:  # what an in-process area judged as it ran
            outcome = _run(case, executor)
        checked = _judge(case, outcome, executor)
        verdict = "passed"
    except Exception as exc:  # noqa: BLE001 - classified: a harness bug is an `error`, never a crash of the run
        failure, error = classify_exception(exc), exc
        verdict, message = failure.failure_class.verdict, str(exc)
    result = CaseResult(case, verdict, message, failure, time.perf_counter() - t0, checked)
    _read_records(result, outcome, fired_before)
    if verdict != "passed":  # what the judge found beside its message (judge.divergence: where it diverged)
        result.details.update(getattr(error, "details", None) or {})
    if case.xfail is not None and verdict != "error":  # an infrastructure error is never an expected failure
        # An expected failure keeps the error it actually showed (`message`) beside why it is expected.
        if verdict == "failed":
            result.verdict = "xfailed"
        elif intermittent(case.xfail):
            # Known to fail in some runs only: this run's values were all judged right, so a pass,
            # said as one (record: `xfail_reason`; terminal, JUnit, HTML: intermittent_outcome).
            result.message = f"{INTERMITTENT_PASS}: {case.xfail}"
        else:
            result.verdict = "xpassed"
            result.message = f"listed as an expected failure but passed: {case.xfail}"
    return _recorded(recorder, result, outcome, taps, executor)


def _recorded(recorder: Recorder | None, result: CaseResult, outcome=None, taps=None, executor=None) -> CaseResult:
    """Step 6. A recording that cannot be written fails the case as an `error` (never a silent gap)."""
    if recorder is None:
        return result
    try:
        where = executor.where(result.case.area, result.scenario) if executor is not None and outcome else ""
        recorder.add(result, outcome, taps, where)
    except Exception as exc:  # noqa: BLE001 - the harness's failure, classified like one
        cause = f"recording failed: {type(exc).__name__}: {exc}"
        result.verdict, result.failure = "error", Classified(FailureClass.INFRASTRUCTURE, cause)
        result.message = f"{cause}\n{result.message}".rstrip()
    return result


def _in_process_fired(case: Case) -> int | None:
    if case.skip or not case.area.in_process:
        return None
    from conformance.adapters import registry

    try:
        return getattr(registry.load(case.adapter_spec), "mutation_fired", None)
    except Exception:  # noqa: BLE001 - the case itself reports a bad adapter
        return None


def _read_records(result: CaseResult, outcome: TaskOutcome | None, fired_before: int | None) -> None:
    """What the ranks' records say whatever the verdict: timings, backward stats, mutation counts."""
    details: dict[str, Any] = {}
    if outcome is not None:
        values = {r: v for r, v in outcome.values.items() if isinstance(v, dict)}
        result.records = len(outcome.values)
        details["seconds"] = outcome.seconds
        if values:
            details["rank_seconds"] = {r: v.get("seconds") for r, v in values.items()}
            details["backward_stats"] = {r: v.get("backward_stats") for r, v in values.items()}
            counts = [c for c in map(_fired_in_record, values.values()) if c is not None]
            result.fired = sum(counts) if counts else None
            details["fired_per_rank"] = {str(r): _fired_in_record(v) for r, v in values.items()}
            result.rank_raised = any(v.get("error") or v.get("crash") for v in values.values())
    if fired_before is not None:
        from conformance.adapters import registry

        after = getattr(registry.load(result.adapter_spec), "mutation_fired", None)
        result.fired = None if after is None else after - fired_before
        result.records = max(result.records, 1)
    if result.checked is not None:
        details.update(result.checked.details)
    result.details = details


def _fired_in_record(value) -> int | None:
    """A rank record's `mutation_fired` (its own, or its `backward_stats()`'s); None if it keeps none."""
    if not isinstance(value, dict):
        return None
    if value.get("mutation_fired") is not None:
        return value["mutation_fired"]
    stats = value.get("backward_stats")
    return stats.get("mutation_fired") if isinstance(stats, dict) else None
