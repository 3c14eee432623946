"""The rank pool's watchdog (conformance/harness/watchdog.py): waiting for a core is activity, a
spinning rank is progress on CPU until the hard cap and no progress on CUDA."""

import pytest


def test_waiting_for_a_core_is_activity_not_a_stall():
    """[Note: timeouts under load]: a runnable process waiting for a core is active.

    Three busy processes pinned to one core: each is runnable all the time, so over a second
    its CPU time plus its run-queue wait add up to about that second, though its CPU alone is a
    third of it (less with other load on the machine).
    """
    import os
    import subprocess
    import sys
    import time

    from conformance.harness.watchdog import Watchdog, activity_sample

    if activity_sample([os.getpid()]) is None or not hasattr(os, "sched_setaffinity"):
        pytest.skip("no /proc or no CPU affinity on this platform")
    core = sorted(os.sched_getaffinity(0))[0]
    spin = f"import os, time; os.sched_setaffinity(0, {{{core}}}); t = time.monotonic() + 8\nwhile time.monotonic() < t: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(3)]
    try:
        time.sleep(1.0)  # pinned and spinning
        watch = Watchdog([procs[0].pid], budget=60)
        time.sleep(1.5)
        sample = activity_sample([procs[0].pid])
        elapsed = time.monotonic() - watch.sampled_at
        active, cpu = watch._active_seconds(sample), sample[0] - watch.cpu
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert active >= 0.6 * elapsed, (active, cpu, elapsed)  # runnable the whole time
    assert active - cpu >= 0.2 * elapsed, (active, cpu, elapsed)  # much of it waiting for the core


def _spinning_watch(monkeypatch, host_progress: bool):
    """A Watchdog over a fake rank that spins at full CPU, on a fake clock: (watch, advance)."""
    import types

    from conformance.harness import watchdog

    clock = [1000.0]
    monkeypatch.setattr(watchdog, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(watchdog, "activity_sample", lambda pids: (clock[0], {}, False))  # one CPU-second per second
    watch = watchdog.Watchdog([12345], budget=30.0, hard_cap=10.0, host_progress=host_progress)

    def advance(seconds: float) -> str:
        """Poll every half second for `seconds`; the first hang verdict, or ''."""
        for _ in range(int(seconds * 2)):
            clock[0] += 0.5
            verdict = watch.hung()
            if verdict:
                return verdict
        return ""

    return watch, advance


def test_on_cpu_a_spinning_rank_is_progress_until_the_hard_cap(monkeypatch):
    watch, advance = _spinning_watch(monkeypatch, host_progress=True)
    assert advance(30.0 * 10 - 1) == ""  # busy: not hung before HARD_CAP x the budget
    assert "still busy" in advance(2.0)


def test_on_cuda_a_spinning_rank_is_not_progress(monkeypatch):
    """[Note: CUDA ranks spin]: a rank blocked in an NCCL collective spins in the host sync, so
    the CUDA pool reports the hang at the budget, not at 10x it."""
    watch, advance = _spinning_watch(monkeypatch, host_progress=False)
    assert advance(29.0) == ""
    verdict = advance(1.5)
    assert verdict.startswith("no answer within the 30s timeout (CUDA ranks: their CPU use is not progress"), verdict
    watch.note_progress()  # a start phase still counts (for STALL_S past the budget, as on CPU)
    assert advance(9.0) == ""
