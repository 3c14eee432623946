"""The coordinator's side of the warm rank services.

A `RankPool` keeps one process per rank of one `Topology` alive across scenarios; spawning a
world costs about 3 s here (import torch + rendezvous), a warm task a few milliseconds.

Failure handling (DESIGN.md, "Harness"):
- every rank must answer every task; a missing answer is a failure, never a pass;
- a task has a timeout; on timeout, or when a rank dies or raises, the pool collects each
  rank's Python stack (faulthandler on SIGUSR1), kills the whole group and is marked BROKEN;
  the next task starts a fresh group, so one failure never poisons the tests after it;
- a failure before the implementation ran (the pool would not start, a rank was gone before
  the task reached it, the task could not be imported) is `infrastructure`: the task is
  retried once on a fresh group, and only then reported (`conformance.judge.failure`).

A task is watched by a `Watchdog` (`conformance.harness.watchdog`: [Note: timeouts under load],
[Note: CUDA ranks spin]): a task's timeout is a budget, not a verdict.

[Note: start phases]
A rank tells the coordinator each step of its start (`Op.PHASE`: spawned, imported torch,
joined the store, joined the group). A phase is progress for the watchdog, and a start that
does fail names the step every rank had reached, so a genuine rendezvous wedge (every rank
past "store", none past "group") is told apart from a slow import. A start's livelock cap is
`STARTUP_HARD_CAP` times its budget: a rendezvous poll (FileStore wakes every 10 ms) counts
as activity under load, so a genuinely wedged start ends there, not at the watchdog's `HARD_CAP`.

[Note: start methods]
A spawned rank is a fresh interpreter: it imports torch, and dynamo with its first optimizer
(torch.optim wraps `Optimizer.__init__` in a dynamo disable), about 3-5 s of CPU per rank. A run
with `-n 2` keeps worlds of 1-4 ranks per worker, 20 ranks: on 2 cores that was a third of
refimpl-ddp's standard profile (220.9 s spawn, 153.1 s forkserver, side by side). So by default
ranks fork from multiprocessing's fork server, which imports `PRELOAD` once per coordinator
before any rank exists (no CUDA context, no process group, no threads of ours); each rank
still gets the coordinator's environment of the moment (`serve`'s `environ`) and its own
process group. `GRADPARITY_START_METHOD=spawn` restores fresh interpreters.
"""

from __future__ import annotations

import enum
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from conformance.harness.service import STACK_SIGNAL, Op, recv, send, serve
from conformance.harness.watchdog import HARD_CAP, Watchdog
from conformance.topology import Topology

STARTUP_TIMEOUT_S = float(os.environ.get("GRADPARITY_STARTUP_TIMEOUT", "60"))
# How rank processes start: "spawn" (a fresh interpreter imports torch in every rank) or
# "forkserver" (one server process imports torch and the rank service once; every rank is forked
# from it). See [Note: start methods].
START_METHOD = os.environ.get(
    "GRADPARITY_START_METHOD", "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "conformance.harness.service"]
ERROR_GRACE_S = 3.0  # how long the other ranks get to answer once one rank has failed
STARTUP_HARD_CAP = 4.0  # a start is given at most this many times STARTUP_TIMEOUT_S ([Note: start phases])
POLL_S = 0.5
STACK_WAIT_S = 5.0  # how long hung ranks get to write their stacks after SIGUSR1


class PoolState(enum.Enum):
    NEW = "new"  # no processes yet
    READY = "ready"  # all ranks joined the group and wait for tasks
    BROKEN = "broken"  # a task failed: the group is killed and replaced on next use
    CLOSED = "closed"


@dataclass
class RankFailure:
    """Why one rank gave no result: it raised, died, or did not answer in time."""

    rank: int
    kind: str  # "raised" | "died" | "timeout" | "no-answer" | "infrastructure"
    message: str
    traceback: str = ""
    stack: str = ""  # the rank's Python stack when the coordinator gave up on it
    log_tail: str = ""

    def render(self) -> str:
        parts = [f"rank {self.rank} {self.kind}: {self.message}"]
        for title, text in (("traceback", self.traceback), ("stack", self.stack), ("log", self.log_tail)):
            if text.strip():
                parts.append(f"--- rank {self.rank} {title} ---\n{text.rstrip()}")
        return "\n".join(parts)


@dataclass
class TaskOutcome:
    """Every rank's answer to one task."""

    label: str
    values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, RankFailure] = field(default_factory=dict)
    seconds: float = 0.0
    attempts: int = 1  # 2 when an infrastructure failure was retried on a fresh group

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def infrastructure(self) -> bool:
        """Failed before the implementation ran, on every failing rank."""
        return bool(self.failures) and all(f.kind == "infrastructure" for f in self.failures.values())

    def render_failures(self) -> str:
        return "\n".join(f.render() for _, f in sorted(self.failures.items()))


class PoolStartError(RuntimeError):
    def __init__(self, message: str, outcome: TaskOutcome):
        super().__init__(message)
        self.outcome = outcome


class RankPool:
    """One warm world of `topology.world_size` rank processes."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.state = PoolState.NEW
        self._procs: list = []
        self._conns: list = []
        self._workdir: str | None = None
        self._task_id = 0
        self.startups = 0  # how many worlds this pool has spawned (1 unless a task failed)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the ranks and wait until all joined the group; PoolStartError otherwise."""
        assert self.state in (PoolState.NEW, PoolState.BROKEN), f"cannot start a pool that is {self.state.value}"
        self._kill()
        self.startups += 1
        # A private (0700) directory: rank logs, stacks and the rendezvous files (see
        # [Note: loopback] in harness/network.py: a FileStore opens no socket at all).
        self._workdir = tempfile.mkdtemp(prefix=f"gradparity-{self.topology.key().replace('/', '-')}-")
        store_path = os.path.join(self._workdir, "rendezvous")
        rpc_init = f"file://{os.path.join(self._workdir, 'rpc-rendezvous')}"  # used only if a task calls ctx.ensure_rpc()
        ctx = _context()
        for rank in range(self.topology.world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=serve,
                args=(rank, self.topology, store_path, child, self._workdir, rpc_init, dict(os.environ)),
                name=f"gradparity-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        outcome = self._collect(TaskOutcome(f"start {self.topology.key()}"), Op.READY, None, STARTUP_TIMEOUT_S,
                                hard_cap=min(HARD_CAP, STARTUP_HARD_CAP))
        if not outcome.ok:
            self._break()
            raise PoolStartError(f"could not start ranks for {self.topology.key()}:\n{outcome.render_failures()}", outcome)
        self.state = PoolState.READY

    def close(self) -> None:
        """Ask every rank to stop; a rank that aborts after saying STOPPED is teardown noise."""
        if self.state == PoolState.READY:
            for conn in self._conns:
                try:
                    send(conn, op=Op.STOP)
                except OSError:
                    pass
            self._collect(TaskOutcome("stop"), Op.STOPPED, None, 10.0)
        self._kill()
        self.state = PoolState.CLOSED

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def workdir(self) -> str | None:
        return self._workdir

    # -- tasks -------------------------------------------------------------------------
    def run(self, fn: str, payload: Any, *, timeout: float, label: str = "") -> TaskOutcome:
        """Run `fn(payload, ctx)` on every rank; always returns an outcome, never hangs.

        An infrastructure failure (nothing of the implementation ran) is retried once on a
        fresh group; the outcome says how many attempts it took.
        """
        start = time.perf_counter()
        for attempt in (1, 2):
            outcome = self._attempt(fn, payload, timeout, label)
            outcome.attempts = attempt
            if not outcome.infrastructure:
                break
        outcome.seconds = time.perf_counter() - start
        return outcome

    def _attempt(self, fn: str, payload: Any, timeout: float, label: str) -> TaskOutcome:
        outcome = TaskOutcome(label or fn)
        if self.state != PoolState.READY:
            try:
                self.start()
            except PoolStartError as exc:
                for rank, failure in exc.outcome.failures.items():
                    outcome.failures[rank] = RankFailure(
                        rank, "infrastructure", f"could not start ranks for {self.topology.key()}: {failure.render()}",
                    )
                return outcome
        self._task_id += 1
        for rank, conn in enumerate(self._conns):
            try:
                send(conn, op=Op.TASK, id=self._task_id, fn=fn, payload=payload, timeout=timeout)
            except OSError as exc:
                outcome.failures[rank] = RankFailure(rank, "infrastructure", f"rank process gone before the task reached it: {exc}")
        if outcome.ok:  # [Note: CUDA ranks spin]
            self._collect(outcome, Op.RESULT, self._task_id, timeout, host_progress=self.topology.device != "cuda")
        if not outcome.ok:
            self._break()
        return outcome

    # -- internals ---------------------------------------------------------------------
    def _collect(self, outcome: TaskOutcome, want: Op, task_id: int | None, timeout: float,
                 hard_cap: float | None = None, host_progress: bool = True) -> TaskOutcome:
        """Wait for one `want` message per rank, watching for deaths, errors and hangs."""
        watch = Watchdog(self.pids, timeout, hard_cap=hard_cap, host_progress=host_progress)
        phases: dict[int, str] = {}  # the start step each rank reached ([Note: start phases])
        grace_until = None
        pending = set(range(len(self._conns)))
        by_conn = {conn: rank for rank, conn in enumerate(self._conns)}
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        hung = ""
        while pending:
            now = time.monotonic()
            if outcome.failures and grace_until is None:  # once one rank failed, the rest get a short grace only
                grace_until = now + ERROR_GRACE_S
            if grace_until is not None and now >= grace_until:
                break
            if want == Op.STOPPED and now - watch.started >= timeout:
                break
            hung = watch.hung() if want != Op.STOPPED else ""
            if hung:
                break
            handles = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            for handle in wait(handles, timeout=POLL_S):
                rank = by_conn.get(handle, by_sentinel.get(handle))
                if rank not in pending:
                    continue
                conn = self._conns[rank]
                message = None
                if conn.poll():
                    try:
                        message = recv(conn)
                    except (EOFError, OSError):
                        message = None  # the pipe closed: the process is gone
                if message is not None:
                    if message["op"] == Op.PHASE:
                        phases[rank] = message["phase"]
                        watch.note_progress()
                    elif message["op"] == Op.ERROR and message.get("id") == task_id:
                        kind = "infrastructure" if message.get("stage") == "setup" else "raised"
                        outcome.failures[rank] = RankFailure(rank, kind, message["error"], message["traceback"])
                        pending.discard(rank)
                    elif message["op"] == want and (task_id is None or message.get("id") == task_id):
                        outcome.values[rank] = message.get("value")
                        pending.discard(rank)
                    continue
                proc = self._procs[rank]
                proc.join(timeout=1.0)
                if want == Op.STOPPED:
                    pending.discard(rank)  # exiting while stopping is what we asked for
                    continue
                outcome.failures[rank] = RankFailure(
                    rank, "died", f"process exited with {_describe_exit(proc.exitcode)} while running {outcome.label}"
                )
                pending.discard(rank)
        if pending and want != Op.STOPPED:
            stacks = self._dump_stacks(pending)
            kind = "no-answer" if outcome.failures else "timeout"
            why = (
                f"no answer within {ERROR_GRACE_S:.0f}s after another rank failed"
                if outcome.failures
                else f"{hung} while running {outcome.label}"
            )
            for rank in pending:
                where = f" (start reached: {phases.get(rank, 'not even spawned')})" if want == Op.READY else ""
                outcome.failures[rank] = RankFailure(rank, kind, f"waiting for {want.value}: {why}{where}",
                                                     stack=stacks.get(rank, ""))
        for failure in outcome.failures.values():
            failure.log_tail = failure.log_tail or self._log_tail(failure.rank)
        return outcome

    def _dump_stacks(self, ranks) -> dict[int, str]:
        for rank in ranks:
            proc = self._procs[rank]
            if proc.is_alive():
                try:
                    os.kill(proc.pid, STACK_SIGNAL)
                except ProcessLookupError:
                    pass
        # A loaded machine may take a while to schedule the handler: wait for the files (up to
        # STACK_WAIT_S), not a fixed nap that is too short exactly when stacks matter most.
        paths = {rank: os.path.join(self._workdir or "", f"rank{rank}.stack") for rank in ranks}
        deadline = time.monotonic() + STACK_WAIT_S
        alive = [paths[r] for r in ranks if self._procs[r].is_alive()]
        while time.monotonic() < deadline and not all(_size(p) > 0 for p in alive):
            time.sleep(0.1)
        time.sleep(0.1)  # let a dump that has started finish
        stacks = {}
        for rank, path in paths.items():
            try:
                with open(path) as fh:
                    stacks[rank] = fh.read()[-6000:] or "(no stack: the process did not answer SIGUSR1)"
            except OSError:
                stacks[rank] = "(no stack file)"
        return stacks

    def _log_tail(self, rank: int, lines: int = 60) -> str:  # enough for a fatal signal's whole stack dump
        try:
            with open(os.path.join(self._workdir or "", f"rank{rank}.log"), errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return ""

    def _break(self) -> None:
        self._kill()
        self.state = PoolState.BROKEN

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._workdir and not os.environ.get("GRADPARITY_KEEP_LOGS"):
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._workdir = None


def _context():
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


class PoolManager:
    """One warm pool per topology; what the pytest plugin keeps for a session."""

    def __init__(self):
        self._pools: dict[Topology, RankPool] = {}

    def get(self, topology: Topology) -> RankPool:
        pool = self._pools.get(topology)
        if pool is None:
            pool = self._pools[topology] = RankPool(topology)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    @property
    def pools(self) -> list[RankPool]:
        return list(self._pools.values())
