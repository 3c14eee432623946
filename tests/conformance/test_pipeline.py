"""The case pipeline (conformance/pipeline.py): every way a case can end becomes one verdict,
one failure class and a one-line cause — and never a pass unless every rank answered and the
judge found nothing. Driven with a fake area and executor (no process is started)."""

import pytest

from conformance import case as case_module
from conformance.area import Area
from conformance.case import Case
from conformance.harness.pool import RankFailure, TaskOutcome
from conformance.judge.compare import ConformanceError
from conformance.judge.contract import Checked
from conformance.pipeline import CaseResult, run_case
from conformance.spec import Scenario

SCENARIO = Scenario(id="ddp/fake/mlp/w2/fp32", area="ddp", model="mlp")


class FakeExecutor:
    def __init__(self, outcome: TaskOutcome):
        self.outcome, self.calls = outcome, []

    def run(self, area, scenario, adapter_spec):
        self.calls.append((area.name, scenario.id, adapter_spec))
        return self.outcome

    def where(self, area, scenario):
        return "fake world"


def _ok(**values) -> TaskOutcome:
    return TaskOutcome("fake", values={0: {"seconds": 0.1, **values}, 1: {"seconds": 0.2, **values}})


@pytest.fixture
def judged(monkeypatch):
    """Install a fake `ddp` area whose judge does what the test says."""
    def install(judge):
        area = Area("ddp", "fake", lambda: [], lambda payload, ctx: None, judge, lambda: None)
        monkeypatch.setattr(case_module, "get_area", lambda name: area)
        return area
    return install


def test_a_pass_needs_every_rank_and_the_judge(judged):
    judged(lambda s, spec, records: Checked(len(records), details={"judged": True}))
    result = run_case(Case(SCENARIO, "torch-ddp"), FakeExecutor(_ok(backward_stats={"mutation_fired": 2})))
    assert result.verdict == "passed" and result.failure is None and result.checked.comparisons == 2
    assert result.records == 2 and result.fired == 4
    assert result.details["judged"] and result.details["rank_seconds"] == {0: 0.1, 1: 0.2}
    record = result.record()
    assert record["case"] == "torch-ddp|ddp/fake/mlp/w2/fp32" and record["verdict"] == "passed"


def test_a_dead_rank_is_a_crash_never_a_pass(judged):
    judged(lambda s, spec, records: pytest.fail("the judge must not run on a broken outcome"))
    outcome = _ok()
    outcome.failures[1] = RankFailure(1, "died", "process exited with signal SIGABRT")
    result = run_case(Case(SCENARIO, "torch-ddp"), FakeExecutor(outcome))
    assert result.verdict == "failed" and result.failure.failure_class.value == "crashed"
    assert result.failure.cause == "rank 1: process exited with signal SIGABRT"
    assert "(on fake world)" in result.message and "repro: gradparity run" in result.message


def test_a_wrong_value_and_a_harness_bug_are_told_apart(judged):
    def wrong(s, spec, records):
        raise ConformanceError("[ddp/fake/mlp/w2/fp32] adapter torch-ddp: rank 0: gradients differ")

    judged(wrong)
    result = run_case(Case(SCENARIO, "torch-ddp"), FakeExecutor(_ok()))
    assert (result.verdict, result.failure.failure_class.value) == ("failed", "wrong value")
    judged(lambda s, spec, records: {}["missing"])
    result = run_case(Case(SCENARIO, "torch-ddp"), FakeExecutor(_ok()))
    assert (result.verdict, result.failure.failure_class.value) == ("error", "infrastructure")
    assert result.failure.cause.startswith("the harness raised KeyError")


def test_an_expected_failure_keeps_the_error_it_showed(judged):
    def wrong(s, spec, records):
        raise ConformanceError("[ddp/fake/mlp/w2/fp32] adapter torch-ddp: rank 0: gradients differ")

    judged(wrong)
    result = run_case(Case(SCENARIO, "torch-ddp", xfail="upstream#1"), FakeExecutor(_ok()))
    assert result.verdict == "xfailed" and "gradients differ" in result.message
    assert result.record()["xfail_reason"] == "upstream#1"
    judged(lambda s, spec, records: Checked(1))
    result = run_case(Case(SCENARIO, "torch-ddp", xfail="upstream#1"), FakeExecutor(_ok()))
    assert result.verdict == "xpassed" and "upstream#1" in result.message  # strict: the list must stay true


def test_an_intermittent_expected_failure_accepts_either_outcome_and_says_which(judged):
    """`intermittent:` entries (a race in the implementation): failing is `xfailed` as for any entry;
    passing is a pass — every value was judged — whose record keeps the reason, never an XPASS."""
    from conformance.report.record import intermittent_outcome

    reason = "ends-world: intermittent: gloo aborts in some runs (x/y#1)"
    judged(lambda s, spec, records: Checked(len(records)))
    result = run_case(Case(SCENARIO, "torch-ddp", xfail=reason), FakeExecutor(_ok()))
    assert result.verdict == "passed" and result.failure is None and result.checked.comparisons == 2
    record = result.record()
    assert record["verdict"] == "passed" and record["xfail_reason"] == reason
    assert record["message"].startswith("passed this run; listed as a known intermittent failure") and reason in record["message"]
    assert intermittent_outcome(record).startswith("known intermittent failure did not happen this run: passed")

    outcome = _ok()
    outcome.failures[1] = RankFailure(1, "died", "process exited with signal SIGABRT")
    result = run_case(Case(SCENARIO, "torch-ddp", xfail=reason), FakeExecutor(outcome))
    assert result.verdict == "xfailed" and result.failure.failure_class.value == "crashed"
    assert result.record()["xfail_reason"] == reason and "SIGABRT" in result.message
    assert intermittent_outcome(result.record()) == ("known intermittent failure happened this run: xfailed "
                                                     "([crashed] rank 1: process exited with signal SIGABRT)")
    # without the marker the same pass stays a strict XPASS
    strict = run_case(Case(SCENARIO, "torch-ddp", xfail="ends-world: gloo aborts"), FakeExecutor(_ok()))
    assert strict.verdict == "xpassed" and intermittent_outcome(strict.record()) == ""


def test_an_infrastructure_error_is_never_an_expected_failure(judged):
    judged(lambda s, spec, records: Checked(1))
    outcome = TaskOutcome("fake")
    outcome.failures[0] = RankFailure(0, "infrastructure", "could not start ranks")
    result = run_case(Case(SCENARIO, "torch-ddp", xfail="upstream#1"), FakeExecutor(outcome))
    assert result.verdict == "error" and result.failure.failure_class.value == "infrastructure"


def test_a_skipped_case_runs_nothing(judged):
    judged(lambda s, spec, records: pytest.fail("must not judge"))
    executor = FakeExecutor(_ok())
    result = run_case(Case(SCENARIO, "torch-ddp", skip="lacks capability: no_sync"), executor)
    assert isinstance(result, CaseResult) and result.verdict == "skipped" and not executor.calls
    assert result.record()["message"] == "lacks capability: no_sync"


def test_an_in_process_area_runs_here_and_its_errors_keep_their_class(monkeypatch):
    from conformance.judge.failure import ImplementationRaised

    def task(payload, ctx):
        assert ctx is None
        raise ImplementationRaised("[x] adapter a: step 0: ValueError: boom", ValueError("boom"))

    area = Area("data_parallel", "fake", lambda: [], task, lambda s, spec, records: records[0], lambda: None,
                in_process=True)
    monkeypatch.setattr(case_module, "get_area", lambda name: area)
    executor = FakeExecutor(_ok())
    result = run_case(Case(SCENARIO, "torch-ddp"), executor)
    assert not executor.calls and result.failure.failure_class.value == "raised"
    assert result.failure.cause == "ValueError: boom"
