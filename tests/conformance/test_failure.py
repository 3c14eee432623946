"""The failure taxonomy: each rank story maps to one class, and the most telling one wins."""

from conformance.harness.pool import RankFailure, TaskOutcome
from conformance.judge.compare import ConformanceError
from conformance.judge.failure import (
    FailureClass,
    classify_exception,
    classify_outcome,
    crash_clue,
    run_failed,
    stuck_at,
)


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


SEGV_LOG = """\
[W init.cpp] some warning
Fatal Python error: Segmentation fault

Current thread 0x00007f (most recent call first):
  File "/x/engine.py", line 12 in _reduce
  File "/x/runner.py", line 40 in run
"""
ABORT_LOG = """terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 8 vs 4
"""
HANG_STACK = """Thread 0x0000aa (most recent call first):
  File "/usr/lib/python3/threading.py", line 320 in wait

Current thread 0x0000bb (most recent call first):
  File "/site/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/x/runner.py", line 88 in run
"""


def test_a_crash_cause_carries_the_logs_fatal_line():
    assert crash_clue(SEGV_LOG) == "Fatal Python error: Segmentation fault"
    assert crash_clue(ABORT_LOG).startswith("terminate called after throwing an instance of 'gloo::EnforceNotMet' what():  [enforce")
    assert crash_clue("loading...\nTraceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory") \
        == "torch.OutOfMemoryError: CUDA out of memory"
    assert crash_clue("just chatter\nmore chatter") == ""
    got = classify_outcome(_outcome(RankFailure(1, "died", "process exited with signal SIGSEGV while running c", log_tail=SEGV_LOG)))
    assert got.cause == ("rank 1: process exited with signal SIGSEGV while running c; "
                         "log: Fatal Python error: Segmentation fault in _reduce (engine.py:12)")
    cut = SEGV_LOG.replace("Current thread 0x00007f (most recent call first):\n", "")  # the tail lost the header
    got = classify_outcome(_outcome(RankFailure(1, "died", "process exited with signal SIGSEGV", log_tail=cut)))
    assert got.cause.endswith("log: Fatal Python error: Segmentation fault")
    single = SEGV_LOG.replace("Current thread 0x00007f (most recent call first):", "Stack (most recent call first):")
    assert stuck_at(single, need_header=True) == "_reduce (engine.py:12)"  # faulthandler without all_threads


def test_a_hang_cause_says_where_the_rank_waits():
    assert stuck_at(HANG_STACK) == "all_reduce (distributed_c10d.py:2501)"
    assert stuck_at("") == ""
    got = classify_outcome(_outcome(RankFailure(0, "timeout", "waiting for result: no CPU used for 10 s", stack=HANG_STACK)))
    assert got.cause == "rank 0: waiting for result: no CPU used for 10 s; stuck in all_reduce (distributed_c10d.py:2501)"


def test_a_pool_that_would_not_start_names_the_ranks_error():
    message = ("could not start ranks for w2/gloo/cpu: rank 1 died: process exited with exit status 1 while running start\n"
               "--- rank 1 log ---\nTraceback (most recent call last):\nRuntimeError: The server socket has failed to listen")
    got = classify_outcome(_outcome(RankFailure(1, "infrastructure", message)))
    assert got.cause.endswith("; RuntimeError: The server socket has failed to listen"), got.cause


def test_exit_status_3_only_when_every_non_pass_is_an_infrastructure_error():
    from conformance.judge.failure import only_infrastructure_errors

    def report(*cases, **summary):
        return {"summary": {"failed": 0, "xpassed": 0, **summary},
                "results": [{"verdict": v, "failure_class": c} for v, c in cases]}

    infra = ("error", "infrastructure")
    assert only_infrastructure_errors(report(("passed", None), infra, ("xfailed", "raised")))
    assert not only_infrastructure_errors(report(("passed", None)))  # nothing went wrong at all
    assert not only_infrastructure_errors(report(infra, ("failed", "wrong value"), failed=1))  # a real failure wins
    assert not only_infrastructure_errors(report(infra, ("xpassed", None), xpassed=1))  # a strict xfail passed
    assert not only_infrastructure_errors(report(infra, ("error", None)))  # an error of no known class
    assert not only_infrastructure_errors({})
