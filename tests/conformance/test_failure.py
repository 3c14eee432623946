"""The failure taxonomy: each rank story maps to one class, and the most telling one wins."""

from conformance.compare import ConformanceError
from conformance.failure import FailureClass, classify_exception, classify_outcome, run_failed
from conformance.harness.pool import RankFailure, TaskOutcome


def _outcome(*failures):
    out = TaskOutcome("case")
    for f in failures:
        out.failures[f.rank] = f
    return out


def test_an_ok_outcome_has_no_class():
    assert classify_outcome(TaskOutcome("case")) is None


def test_each_kind_has_its_class_and_a_one_line_cause():
    cases = {
        "died": FailureClass.CRASHED, "raised": FailureClass.RAISED, "timeout": FailureClass.HUNG,
        "no-answer": FailureClass.HUNG, "infrastructure": FailureClass.INFRASTRUCTURE,
    }
    for kind, cls in cases.items():
        got = classify_outcome(_outcome(RankFailure(1, kind, "first line\nsecond line")))
        assert got.failure_class is cls, kind
        assert got.cause == "rank 1: first line"


def test_a_crash_explains_a_peers_error_and_a_raise_explains_a_peers_wait():
    got = classify_outcome(_outcome(RankFailure(0, "raised", "RuntimeError: Connection closed by peer"),
                                    RankFailure(1, "died", "process exited with signal SIGSEGV")))
    assert got.failure_class is FailureClass.CRASHED and "SIGSEGV" in got.cause
    got = classify_outcome(_outcome(RankFailure(0, "no-answer", "waiting"), RankFailure(1, "raised", "ValueError: x")))
    assert got.failure_class is FailureClass.RAISED and got.cause == "rank 1: ValueError: x"


def test_infrastructure_only_when_every_failing_rank_is_infrastructure():
    got = classify_outcome(_outcome(RankFailure(0, "infrastructure", "gone"), RankFailure(1, "raised", "ValueError: x")))
    assert got.failure_class is FailureClass.RAISED
    assert FailureClass.INFRASTRUCTURE.verdict == "error" and FailureClass.HUNG.verdict == "failed"


def test_exceptions_keep_their_class():
    err = run_failed("ddp/x", "torch-ddp", _outcome(RankFailure(1, "timeout", "waiting for result: no answer")), repro="r")
    assert classify_exception(err).failure_class is FailureClass.HUNG
    assert str(err).splitlines()[0] == "[ddp/x] adapter torch-ddp: hung: rank 1: waiting for result: no answer"
    assert classify_exception(ConformanceError("[s] rank 0: grads differ\n  more")).line() == "wrong value: [s] rank 0: grads differ"
    harness_bug = classify_exception(KeyError("x"))
    assert harness_bug.failure_class is FailureClass.INFRASTRUCTURE and "KeyError" in harness_bug.cause
