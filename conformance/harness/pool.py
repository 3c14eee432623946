"""The coordinator's side of the warm rank services.

A `RankPool` keeps one process per rank of one `Topology` alive across scenarios; spawning a
world costs about 3 s here (import torch + rendezvous), a warm task a few milliseconds.

Failure handling (DESIGN.md, "Harness"):
- every rank must answer every task; a missing answer is a failure, never a pass;
- a task has a timeout; on timeout, or when a rank dies or raises, the pool collects each
  rank's Python stack (faulthandler on SIGUSR1), kills the whole group and is marked BROKEN;
  the next task starts a fresh group, so one failure never poisons the tests after it.
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
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

from conformance.harness.context import Topology
from conformance.harness.service import STACK_SIGNAL, Op, recv, send, serve

STARTUP_TIMEOUT_S = float(os.environ.get("GRADPARITY_STARTUP_TIMEOUT", "120"))
ERROR_GRACE_S = 3.0  # how long the other ranks get to answer once one rank has failed


class PoolState(enum.Enum):
    NEW = "new"  # no processes yet
    READY = "ready"  # all ranks joined the group and wait for tasks
    BROKEN = "broken"  # a task failed: the group is killed and replaced on next use
    CLOSED = "closed"


@dataclass
class RankFailure:
    """Why one rank gave no result: it raised, died, or did not answer in time."""

    rank: int
    kind: str  # "raised" | "died" | "timeout" | "no-answer"
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

    @property
    def ok(self) -> bool:
        return not self.failures

    def render_failures(self) -> str:
        return "\n".join(f.render() for _, f in sorted(self.failures.items()))


class PoolStartError(RuntimeError):
    pass


class RankPool:
    """One warm world of `topology.world_size` rank processes."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.state = PoolState.NEW
        self._procs: list = []
        self._conns: list = []
        self._store = None
        self._workdir: str | None = None
        self._task_id = 0
        self.startups = 0  # how many worlds this pool has spawned (1 unless a task failed)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        import torch.distributed as dist

        assert self.state in (PoolState.NEW, PoolState.BROKEN), f"cannot start a pool that is {self.state.value}"
        self._kill()
        self.startups += 1
        self._workdir = tempfile.mkdtemp(prefix=f"gradparity-{self.topology.key().replace('/', '-')}-")
        # The coordinator binds the store itself (port 0): no race with other xdist workers.
        self._store = dist.TCPStore(
            "127.0.0.1", 0, self.topology.world_size, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
        )
        # A file rendezvous for torch.distributed.rpc, used only if a task calls ctx.ensure_rpc().
        rpc_init = f"file://{os.path.join(self._workdir, 'rpc-rendezvous')}"
        ctx = mp.get_context("spawn")
        for rank in range(self.topology.world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=serve,
                args=(rank, self.topology, self._store.port, child, self._workdir, rpc_init),
                name=f"gradparity-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        outcome = self._collect(TaskOutcome(f"start {self.topology.key()}"), Op.READY, None, STARTUP_TIMEOUT_S)
        if not outcome.ok:
            self._break()
            raise PoolStartError(f"could not start ranks for {self.topology.key()}:\n{outcome.render_failures()}")
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

    # -- tasks -------------------------------------------------------------------------
    def run(self, fn: str, payload: Any, *, timeout: float, label: str = "") -> TaskOutcome:
        """Run `fn(payload, ctx)` on every rank; always returns an outcome, never hangs."""
        start = time.perf_counter()
        if self.state != PoolState.READY:
            self.start()
        self._task_id += 1
        outcome = TaskOutcome(label or fn)
        for rank, conn in enumerate(self._conns):
            try:
                send(conn, op=Op.TASK, id=self._task_id, fn=fn, payload=payload)
            except OSError as exc:
                outcome.failures[rank] = RankFailure(rank, "died", f"could not send the task: {exc}")
        if outcome.ok:
            self._collect(outcome, Op.RESULT, self._task_id, timeout)
        if not outcome.ok:
            self._break()
        outcome.seconds = time.perf_counter() - start
        return outcome

    # -- internals ---------------------------------------------------------------------
    def _collect(self, outcome: TaskOutcome, want: Op, task_id: int | None, timeout: float) -> TaskOutcome:
        """Wait for one `want` message per rank, watching for deaths, errors and the deadline."""
        deadline = time.monotonic() + timeout
        pending = set(range(len(self._conns)))
        by_conn = {conn: rank for rank, conn in enumerate(self._conns)}
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while pending:
            now = time.monotonic()
            if outcome.failures:  # once one rank failed, the rest get a short grace only
                deadline = min(deadline, now + ERROR_GRACE_S)
            remaining = deadline - now
            if remaining <= 0:
                break
            handles = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            for handle in wait(handles, timeout=remaining):
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
                    if message["op"] == Op.ERROR and message.get("id") == task_id:
                        outcome.failures[rank] = RankFailure(rank, "raised", message["error"], message["traceback"])
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
                else f"no answer within the {timeout:.0f}s timeout while running {outcome.label}"
            )
            for rank in pending:
                outcome.failures[rank] = RankFailure(rank, kind, f"waiting for {want.value}: {why}", stack=stacks.get(rank, ""))
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
        time.sleep(0.5)
        stacks = {}
        for rank in ranks:
            path = os.path.join(self._workdir or "", f"rank{rank}.stack")
            try:
                with open(path) as fh:
                    stacks[rank] = fh.read()[-6000:] or "(no stack: the process did not answer SIGUSR1)"
            except OSError:
                stacks[rank] = "(no stack file)"
        return stacks

    def _log_tail(self, rank: int, lines: int = 20) -> str:
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
        self._store = None
        if self._workdir and not os.environ.get("GRADPARITY_KEEP_LOGS"):
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._workdir = None


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
