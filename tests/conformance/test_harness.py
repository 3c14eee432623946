"""The warm rank pool's failure paths: each is a failure with the rank's traceback or stack,
reported within the timeout, and the next task passes on a fresh group."""

import pytest

from conformance.harness.pool import PoolState, RankPool
from conformance.topology import choose_topology

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("harness")]
PROBE = "conformance.harness.probes:"


@pytest.fixture(scope="module")
def pool():
    p = RankPool(choose_topology(2, "cpu"))
    yield p
    p.close()


def _recovers(pool):
    outcome = pool.run(PROBE + "echo", "after", timeout=60)
    assert outcome.ok, outcome.render_failures()
    assert outcome.values[0]["sum"] == 1.0 and outcome.values[1]["payload"] == "after"


def test_warm_pool_reuses_processes(pool):
    pool.run(PROBE + "echo", 0, timeout=60)
    starts = pool.startups
    for i in range(5):
        outcome = pool.run(PROBE + "echo", i, timeout=60)
        assert outcome.ok and {r: v["payload"] for r, v in outcome.values.items()} == {0: i, 1: i}
    assert pool.startups == starts, "a healthy pool must not restart between tasks"


def test_rank_that_raises(pool):
    outcome = pool.run(PROBE + "raise_on", 1, timeout=30)
    assert not outcome.ok  # reported by its kind, not by a wall-clock bound (a loaded machine is slow, not wrong)
    assert outcome.failures[1].kind == "raised"
    assert "deliberate failure on rank 1" in outcome.failures[1].traceback
    # rank 0 was blocked in a collective: it is reported with its stack, not passed
    assert outcome.failures[0].kind in ("no-answer", "raised")
    assert pool.state == PoolState.BROKEN
    _recovers(pool)


def test_rank_that_exits(pool):
    outcome = pool.run(PROBE + "exit_on", 1, timeout=30)
    assert not outcome.ok  # reported by its kind, not by a wall-clock bound (a loaded machine is slow, not wrong)
    assert outcome.failures[1].kind == "died"
    assert "exit status 3" in outcome.failures[1].message
    _recovers(pool)


def test_a_crash_says_its_cause_in_one_line(pool):
    """The signal and the dead rank's last words (faulthandler's fatal error, the exception line)."""
    from conformance.judge.failure import FailureClass, classify_outcome

    outcome = pool.run(PROBE + "abort_on", 1, timeout=30)
    assert outcome.failures[1].kind == "died"
    classified = classify_outcome(outcome)
    assert classified.failure_class is FailureClass.CRASHED
    assert "signal SIGABRT" in classified.cause and "Fatal Python error: Aborted" in classified.cause, classified.cause
    assert "\n" not in classified.cause
    _recovers(pool)


def test_rank_that_hangs_in_a_collective(pool):
    from conformance.judge.failure import classify_outcome

    _recovers(pool)  # a warm world: the bound below is about the task, not a cold start
    outcome = pool.run(PROBE + "hang_on", 1, timeout=4)
    assert not outcome.ok
    assert {f.kind for f in outcome.failures.values()} == {"timeout"}
    assert "time.sleep" in outcome.failures[1].stack or "hang_on" in outcome.failures[1].stack
    assert "all_reduce" in outcome.failures[0].stack
    cause = classify_outcome(outcome).cause  # what the hung rank was waiting in, not only that it hung
    assert cause.startswith("rank 0: waiting for result") and "; stuck in " in cause and "all_reduce" in cause, cause
    assert "4s timeout" in outcome.failures[0].message
    _recovers(pool)


def test_pending_collective_poisons_nothing(pool):
    """A task that leaves a collective in flight fails the consistency check, not the next task."""
    outcome = pool.run(PROBE + "leave_pending", None, timeout=4)
    assert not outcome.ok
    _recovers(pool)


def test_clean_teardown_is_not_a_failure():
    p = RankPool(choose_topology(1, "cpu"))
    assert p.run(PROBE + "echo", 1, timeout=60).ok
    p.close()
    assert p.state == PoolState.CLOSED


def test_a_busy_task_past_its_budget_is_not_a_hang(pool):
    """Ranks that keep computing are slow, not hung: the budget is extended while they use CPU."""
    outcome = pool.run(PROBE + "busy", 4.0, timeout=1.5)
    assert outcome.ok, outcome.render_failures()
    assert outcome.seconds >= 4.0


def test_a_task_that_cannot_be_imported_is_infrastructure_retried_once(pool):
    from conformance.judge.failure import FailureClass, classify_outcome

    outcome = pool.run("conformance.harness.probes:no_such_task", None, timeout=30)
    assert outcome.infrastructure and outcome.attempts == 2
    classified = classify_outcome(outcome)
    assert classified.failure_class is FailureClass.INFRASTRUCTURE and "no_such_task" in classified.cause
    _recovers(pool)


def test_a_pool_that_cannot_start_is_infrastructure_not_a_failure(monkeypatch):
    import conformance.harness.pool as pool_module
    from conformance.judge.failure import FailureClass, classify_outcome

    monkeypatch.setattr(pool_module, "STARTUP_TIMEOUT_S", 0.01)
    monkeypatch.setattr(pool_module, "HARD_CAP", 1.0)
    p = RankPool(choose_topology(2, "cpu"))
    try:
        outcome = p.run(PROBE + "echo", 0, timeout=30)
    finally:
        p.close()
    assert outcome.attempts == 2 and p.startups == 2
    assert classify_outcome(outcome).failure_class is FailureClass.INFRASTRUCTURE
    assert "could not start ranks" in outcome.failures[0].message
    assert "(start reached: " in outcome.failures[0].message  # which step of the start it was in


def test_the_pool_watches_cuda_tasks_without_host_progress(monkeypatch):
    """RankPool hands the task's Watchdog host_progress=False exactly when its topology is CUDA."""
    from conformance.harness import pool
    from conformance.topology import Topology

    seen = []
    monkeypatch.setattr(pool.RankPool, "_collect", lambda self, outcome, want, task_id, timeout, **kw: seen.append(kw) or outcome)
    monkeypatch.setattr(pool.RankPool, "start", lambda self: setattr(self, "state", pool.PoolState.READY))
    for device in ("cpu", "cuda"):
        p = pool.RankPool(Topology(1, "nccl" if device == "cuda" else "gloo", device))
        p._conns = []
        p._attempt("fn", None, 1.0, "label")
    assert [kw.get("host_progress") for kw in seen] == [True, False]


def test_hsdp_cases_reuse_one_mesh_per_rank(pool):
    """A HSDP case's mesh is made once per warm rank and reused: a mesh per case made new
    process groups (NCCL communicators) at every case, never destroyed."""
    answers = []
    for _case in range(3):
        outcome = pool.run(PROBE + "hsdp_case", 2, timeout=60)
        assert outcome.ok, outcome.render_failures()
        answers.append(outcome.values)
    assert [a[0]["first"] for a in answers] == [True, False, False]
    assert all(a[r]["same_groups"] for a in answers[1:] for r in (0, 1)), answers


def test_rank_tasks_run_under_the_collective_device_check(monkeypatch):
    """RankContext.collective_check wraps every task (refimpl.device_check): with the CPU
    stand-in on, a task that all-reduces a tensor built without `device=` is reported as raised,
    naming the line; the same tensor on the rank's device passes."""
    monkeypatch.setenv("GRADPARITY_CHECK_DEVICES", "stand-in")  # the ranks inherit it at spawn
    p = RankPool(choose_topology(2, "cpu"))
    try:
        bad = p.run(PROBE + "device_less_all_reduce", False, timeout=60)
        good = p.run(PROBE + "device_less_all_reduce", True, timeout=60)
    finally:
        p.close()
    assert not bad.ok and {f.kind for f in bad.failures.values()} == {"raised"}
    error = bad.failures[0].message
    assert "CollectiveDeviceError: dist.all_reduce got a tensor on meta" in error and "probes.py" in error
    assert good.ok and good.values == {0: 2.0, 1: 2.0}


def test_the_device_check_is_on_for_nccl_and_on_request():
    from conformance.harness.context import RankContext
    from conformance.topology import Topology

    def checked(ctx) -> bool:
        return type(ctx.collective_check()).__name__ == "_GeneratorContextManager"

    assert checked(RankContext(0, Topology(2, "nccl", "cuda"), None))
    assert not checked(RankContext(0, Topology(2, "gloo", "cuda", shared_gpu=True), None))  # gloo takes CPU tensors too
    assert not checked(RankContext(0, Topology(2, "gloo", "cpu"), None))
