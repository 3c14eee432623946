"""When waiting for ranks has become a hang: the rank pool's watchdog (`conformance.harness.pool`).

[Note: timeouts under load]
A slow or oversubscribed machine must never turn into a failure, and a hang must not take
minutes to detect on an idle one. So a task's timeout is a budget, not a verdict: once it is
spent, the pool declares a hang only if no rank has shown activity for `STALL_S` (a rank
blocked in a collective, or asleep, shows none), or if the ranks are still busy after
`HARD_CAP` times the budget (a livelock). On an idle machine a hang is reported right at the
budget, as before.

Activity is not CPU time alone (`activity_sample`): a rank that is runnable but waits for a
core (the run-queue delay, /proc/<pid>/task/*/schedstat, of a thread in state R), or that waits for the disk (a
thread in state D: page faults on torch's libraries when memory is tight), is working, not
stalled. Measured here (2 cores, load 26, ranks starting): each rank got 0.02 CPU-s per
second and 1.0 s of run-queue wait per second. With the kernel's per-session fair share
(sched_autogroup, on here) a starting world's CPU share shrinks with every other busy
session, and ranks that page torch's libraries back in use no CPU at all: a CPU-rate rule
alone can call such a start "idle" and fail it as an infrastructure error, as seen on a
loaded machine (issue #26: w4 pools failing to start twice at load 12-13, every rank
"idle" for 11 s). The exact trigger was not reproduced here; both causes are covered.

[Note: CUDA ranks spin]
A rank waiting for an NCCL collective that never completes does not sleep: the host thread
spins in the next synchronisation (a ``.item()``, a ``synchronize``) at full CPU. So on a CUDA
pool, CPU time and run-queue wait say nothing about progress, and a task's budget is its
verdict (start phases still count): a hang is reported at the budget, not after `HARD_CAP` times
it. Give a loaded GPU machine more time with `--timeout-scale`.
"""

from __future__ import annotations

import os
import time

STALL_S = float(os.environ.get("GRADPARITY_STALL_S", "10"))  # no CPU used by any rank for this long: stalled
HARD_CAP = 10.0  # a busy task is given at most this many times its budget
MIN_PROGRESS_RATE = 0.03  # activity seconds per second (all ranks together) that count as progress


def cpu_seconds(pids) -> float | None:
    """CPU time (user + system, all threads) the processes have used; None where /proc is absent."""
    total, ticks = 0, os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            if not os.path.exists("/proc/self/stat"):
                return None
            continue  # the process is gone: it adds nothing
        total += int(fields[11]) + int(fields[12])
    return total / ticks


def activity_sample(pids) -> tuple[float, dict[str, float], bool] | None:
    """(CPU seconds of the processes, run-queue wait of each thread runnable now, any thread in D).

    See [Note: timeouts under load]. CPU comes from each process's own counters (threads that
    ended still count); run-queue wait (schedstat) only from threads in state R, since a blocked
    thread that wakes now and then (a timed wait in a collective) waits for a core too under
    load and must not add up to "busy". None without /proc.
    """
    cpu = cpu_seconds(pids)
    if cpu is None:
        return None
    waiting, io_wait = {}, False
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # the process is gone
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                    state = fh.read().rsplit(")", 1)[1].split()[0]
                if state == "R":
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                        waiting[f"{pid}/{tid}"] = int(fh.read().split()[1]) / 1e9
            except (OSError, IndexError, ValueError):
                continue  # the thread ended between listing and reading, or no schedstat
            io_wait = io_wait or state == "D"
    return cpu, waiting, io_wait


class Watchdog:
    """When waiting for ranks has become a hang (see [Note: timeouts under load])."""

    def __init__(self, pids, budget: float, hard_cap: float | None = None, host_progress: bool = True):
        """``host_progress=False``: the processes' CPU use and run-queue wait are not progress
        (CUDA ranks, [Note: CUDA ranks spin]); only :meth:`note_progress` is."""
        self.pids, self.budget = list(pids), budget
        self.hard_cap = HARD_CAP if hard_cap is None else hard_cap
        self.host_progress = host_progress
        self.started = self.progressed_at = self.sampled_at = time.monotonic()
        sample = activity_sample(self.pids)
        self.cpu = None if sample is None else sample[0]
        self.waiting = {} if sample is None else sample[1]

    def note_progress(self) -> None:
        """A rank said it moved on (a start phase): progress whatever the counters say."""
        self.progressed_at = time.monotonic()

    def _active_seconds(self, sample) -> float:
        """CPU used since the last sample, plus the run-queue wait since then of threads that
        were runnable at both samples (a thread that is runnable now waits for a core)."""
        cpu, waiting, _ = sample
        waited = sum(max(0.0, d - self.waiting[t]) for t, d in waiting.items() if t in self.waiting)
        return (cpu - self.cpu) + waited

    def hung(self) -> str:
        """'' while the task may still answer; otherwise why it is considered hung.

        Progress is an activity *rate* over about a second: blocked ranks still tick now and
        then (gloo's and faulthandler's threads), which must not add up to "progress".
        """
        now = time.monotonic()
        sample = activity_sample(self.pids) if now - self.sampled_at >= 1.0 else None
        if sample is not None and self.cpu is not None:
            active = sample[2] or self._active_seconds(sample) / (now - self.sampled_at) >= MIN_PROGRESS_RATE
            if active and self.host_progress:
                self.progressed_at = now
            self.cpu, self.waiting, self.sampled_at = sample[0], sample[1], now
        elapsed = now - self.started
        if elapsed < self.budget:
            return ""
        if self.cpu is None:  # no /proc: a plain timeout
            return f"no answer within the {self.budget:g}s timeout"
        idle = now - self.progressed_at
        if not self.host_progress and idle >= self.budget:
            return (f"no answer within the {self.budget:g}s timeout (CUDA ranks: their CPU use is not progress, "
                    "a rank blocked in an NCCL collective spins)")
        if idle >= min(STALL_S, self.budget):
            return (f"no answer within the {self.budget:g}s timeout"
                    + (f" (waited {elapsed:.0f}s; no rank ran, waited for a core or for the disk in the last {idle:.0f}s)"
                       if elapsed > self.budget + 1 else ""))
        if elapsed >= self.budget * self.hard_cap:
            return f"still busy but no answer after {elapsed:.3g}s ({self.hard_cap:g}x the {self.budget:g}s timeout)"
        return ""
