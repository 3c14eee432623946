"""The rank loop under `torchrun` (multi-node): rank 0 coordinates, every rank serves.

    torchrun --nnodes 2 --nproc-per-node 4 ... -m conformance.frontends.torchrun \\
        --adapter torch-ddp --profile standard --report-dir reports/multinode

The same plan (`conformance.plan`) and the same case pipeline (`conformance.pipeline.run_case`)
as `gradparity run`; only the executor differs: the torchrun world instead of a warm pool.
Every area runs: rank areas on the whole world (scenarios whose world size is the torchrun
world's), single-process areas (data_parallel) on rank 0 alone.

Network: unlike the local pool (loopback only, harness/network.py), this keeps torch's
behaviour on purpose: the rendezvous (torchrun's TCPStore on MASTER_ADDR:MASTER_PORT, which
listens on every interface) and gloo's pairs (the interface the hostname resolves to, or
GLOO_SOCKET_IFNAME) must be reachable from the other nodes; RPC (dist_autograd) rendezvous in
torchrun's store too, and TensorPipe follows the same hostname resolution.

[Note: a world cannot be respawned]
The coordinator cannot replace a torchrun world, so a crash or a hang (bounded by the process
group's timeout, `--timeout`) ends the run. The report survives it: rank 0 rewrites the
reports after every case, with every case not yet run listed as an `error` that says why
(when the world broke: which case broke it; before that: "the run stopped before this case"),
so even a rank 0 killed by the torchrun agent leaves a report that accounts for every case.
Expected failures (the xfail lists) run last, so that a known upstream crash cannot take
healthy cases with it; those whose reason is marked `ends-world:` (a rank aborts or hangs) are
skipped with that reason instead, since the world they would end is the run's only one (the
warm pool of `gradparity run` respawns a world and runs them).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from conformance import cuda_setup
from conformance.adapters import registry
from conformance.case import Case
from conformance.expectations import ends_world
from conformance.frontends import options
from conformance.frontends.cli import OneLineParser
from conformance.harness.context import RankContext, configure_rank_threads
from conformance.harness.network import loopback_interface
from conformance.harness.pool import RankFailure, TaskOutcome
from conformance.judge.failure import Classified, FailureClass
from conformance.pipeline import CaseResult, run_case
from conformance.plan import make_plan
from conformance.topology import Topology
from conformance.validation import UsageError

# Rank 0 writes its reports after every case and a SIGTERM thread may write them at any moment:
# one writer at a time (both would write the same temporary files), and none after the summary.
_REPORTING = threading.Lock()
_FINISHED = threading.Event()


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m conformance.frontends.torchrun")
    options.add_to_argparse(p)
    p.add_argument("--area", action="append", default=[], choices=options.AREA_CHOICES, help="only these areas (repeatable)")
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds")
    return p


class TorchrunWorld:
    """The executor: every rank runs the task on itself; rank 0 gathers the answers."""

    def __init__(self, ctx: RankContext, control, timeout_scale: float = 1.0):
        self.ctx, self.control, self.timeout_scale = ctx, control, timeout_scale
        self.broken = ""  # why the world can no longer run a task (it cannot be respawned)

    def run(self, area, scenario, adapter_spec) -> TaskOutcome | None:
        start = time.perf_counter()
        try:
            self.ctx.bound_collectives(scenario.timeout_s * self.timeout_scale)
            with self.ctx.collective_check():
                answer = {"ok": True, "value": area.task((scenario, adapter_spec), self.ctx)}
        except Exception as exc:  # noqa: BLE001 - the implementation's error, packaged like the pool's service does
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        world = self.ctx.world_size
        gathered = [None] * world if self.ctx.rank == 0 else None
        outcome = TaskOutcome(f"{scenario.id} with {adapter_spec}")
        try:
            dist.gather_object(answer, gathered, dst=0, group=self.control)
        except Exception as exc:  # noqa: BLE001 - a rank died, or hung past the group timeout
            error = f"{type(exc).__name__}: {exc}"
            # A peer that died closes its connections; one that hangs lets the group time out.
            died = any(w in error.lower() for w in ("connection closed", "reset by peer", "broken pipe"))
            outcome.failures[0] = RankFailure(0, "died" if died else "timeout", f"gathering results failed: {error}")
            self.broken = f"the torchrun world broke during {adapter_spec}|{scenario.id}: {error.splitlines()[0][:200]}"
        else:
            for r, a in enumerate(gathered or []):
                if a is None:
                    outcome.failures[r] = RankFailure(r, "no-answer", "no result")
                elif a["ok"]:
                    outcome.values[r] = a["value"]
                else:
                    outcome.failures[r] = RankFailure(r, "raised", a["error"], a["traceback"])
        outcome.seconds = time.perf_counter() - start
        return outcome if self.ctx.rank == 0 else None

    def sync(self) -> None:
        """Meet the other ranks after a case only rank 0 runs (single-process areas): no rank
        then waits longer than one case, so the group's timeout stays a bound on one case."""
        try:
            dist.gather_object(None, [None] * self.ctx.world_size if self.ctx.rank == 0 else None, dst=0,
                               group=self.control)
        except Exception as exc:  # noqa: BLE001 - a rank died meanwhile
            self.broken = f"the torchrun world broke while rank 0 ran a single-process case: {str(exc).splitlines()[0][:200]}"

    def where(self, area, scenario) -> str:  # noqa: ARG002 - one world for every case
        return f"torchrun world {self.ctx.world_size} ({self.ctx.backend})"


def never_ran(case: Case, why: str) -> CaseResult:
    """A planned case the run could not reach: an `error` (no verdict), never a pass."""
    cause = Classified(FailureClass.INFRASTRUCTURE, f"never ran: {why}")
    return CaseResult(case, "error", cause.cause, cause)


def _order(cases: list[Case]) -> list[Case]:
    """Expected failures last (a known crash must not take healthy cases with it); skips first.

    An expected failure known to end the world is skipped with its reason: running it would
    turn a known upstream bug into a dead torchrun run (see [Note: a world cannot be respawned]).
    """
    cases = [replace(c, skip=f"not run under torchrun: {c.xfail} (a torchrun world cannot be respawned; "
                             "`gradparity run` runs it)", xfail=None) if not c.skip and ends_world(c.xfail) else c
             for c in cases]
    return sorted(cases, key=lambda c: (not c.skip, c.xfail is not None))


def setup_rank(env, cuda_available: bool) -> tuple[str, str, int]:
    """(device type, backend, local rank) of this torchrun process, its CUDA set up first
    (conformance/cuda_setup.py): the GPU of its *local* rank, NCCL on loopback only when every
    rank is on this node (``LOCAL_WORLD_SIZE == WORLD_SIZE``)."""
    device = "cuda" if cuda_available and env.get("GRADPARITY_DEVICE", "cuda") == "cuda" else "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
    local_rank = cuda_setup.local_rank(env, default=0)
    if device == "cuda":
        one_node = env.get("LOCAL_WORLD_SIZE") is not None and env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE")
        cuda_setup.setup_process(backend=backend, loopback=loopback_interface() if one_node else None,
                                 device=cuda_setup.local_device(local_rank), env=env)
    return device, backend, local_rank


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        selection = options.selection(args, areas=args.area)
    except (UsageError, registry.AdapterError) as exc:
        print(f"gradparity: error: {exc}", file=sys.stderr)
        return 2
    ctx, world_run, control = _join_world(args)
    box, unmatched = [None], []
    if ctx.rank == 0:
        box[0], unmatched = _plan(args, selection, ctx)
    dist.broadcast_object_list(box, src=0, group=control)
    cases: list[Case] = box[0]
    results = _run_cases(args, selection, ctx, world_run, cases, unmatched)
    code = _finish(args, selection, results, world_run, unmatched) if ctx.rank == 0 else 0
    if not world_run.broken:
        if ctx.scratch.get("rpc"):
            from torch.distributed import rpc

            rpc.shutdown()  # collective: every rank ran the same RPC cases
        dist.destroy_process_group()
    return code


def _join_world(args):
    """This rank's process group (the backend its device calls for), a gloo group for control
    messages, and the executor that runs a case's task on every rank of this world."""
    configure_rank_threads()
    device, backend, local_rank = setup_rank(os.environ, torch.cuda.is_available())
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout))
    # RPC (dist_autograd) rendezvous through torchrun's own store (MASTER_ADDR:MASTER_PORT, which
    # every rank reaches as a client); torch prefixes RPC's keys, so they cannot meet the group's.
    ctx = RankContext(rank, Topology(world, backend, device), dist.group.WORLD, rpc_init_method="env://",
                      local_rank=local_rank)
    return ctx, TorchrunWorld(ctx, control, getattr(args, "timeout_scale", 1.0)), control


def _plan(args, selection, ctx) -> tuple[list[Case], list[str]]:
    """Rank 0: the cases this world runs (and the expectations that matched nothing); starts the
    reports and the recording."""
    device, backend, world = ctx.topology.device, ctx.topology.backend, ctx.topology.world_size
    plan = make_plan(replace(selection, device=device))
    # Rank areas need scenarios of this world's size; single-process areas run on rank 0.
    cases = _order([c for c in plan.cases if c.area.in_process or c.scenario.world_size == world])
    from conformance.report import run_info, start_run

    start_run(args.report_dir)  # one run per directory: the last one's files go now
    args.run_info = run_info.collect(profile=selection.profile, backend=backend, device=device,
                                     adapters=list(selection.specs))
    if args.record:  # --record DIR: rank 0 records every case it judges (conformance/recording.py)
        from conformance.recording import Recorder

        args.recorder = Recorder(args.record)
        args.recorder.start(args.run_info)
    print(f"gradparity torchrun: world {world} ({backend}/{device}), {len(cases)} cases "
          f"({sum(bool(c.skip) for c in cases)} skipped)", flush=True)
    for line in plan.unmatched:
        print(f"warning: {line}", flush=True)
    return cases, plan.unmatched


def _run_cases(args, selection, ctx, world_run, cases: list[Case], unmatched: list[str]) -> list[CaseResult]:
    """Every case, in order: rank 0 runs the pipeline (and judges), the other ranks serve its tasks."""
    results: list[CaseResult] = []
    if ctx.rank == 0:
        _on_sigterm(args, selection, results, cases, unmatched)
    for index, case in enumerate(cases):
        if ctx.rank != 0:
            if not case.skip and not case.area.in_process:
                world_run.run(case.area, case.scenario, case.adapter_spec)
            elif not case.skip:
                world_run.sync()  # wait for rank 0's single-process case, one case at a time
            if world_run.broken:
                break
            continue
        if world_run.broken:
            result = never_ran(case, world_run.broken)
        else:
            result = run_case(case, world_run, getattr(args, "recorder", None))
            if not case.skip and case.area.in_process:
                world_run.sync()
        results.append(result)
        _progress(index, len(cases), result)
        _write(args, selection, results, cases[index + 1:], world_run.broken)
    return results


def _finish(args, selection, results: list[CaseResult], world_run, unmatched: list[str]) -> int:
    """Rank 0: the reports, the summary and the recording; the exit status."""
    from conformance.report.terminal import print_run_summary

    with _REPORTING:  # a SIGTERM from now on waits for the summary, then goes without a second one
        _FINISHED.set()
        written = _write(args, selection, results, [], world_run.broken, locked=True)
        records = [r.record() for r in results]
        print_run_summary(records, written, unmatched, stopped=world_run.broken)
        if getattr(args, "recorder", None) is not None:
            index = args.recorder.finish(args.run_info, stopped=world_run.broken or None)
            print(f"recording: {args.record} ({len(index['case_files'])} cases, {index['bytes'] / 1e6:.1f} MB)",
                  flush=True)
        return _exit_status(records)


def _on_sigterm(args, selection, results: list[CaseResult], cases: list[Case], unmatched: list[str]) -> None:
    """The torchrun agent stops every rank once one has exited (e.g. an expected crash): rank 0
    then still says what happened — the report with every case, and the summary — before it goes."""
    def stop() -> None:
        from conformance.report.terminal import print_run_summary

        _REPORTING.acquire()  # the main thread may be writing the reports: let it finish them
        if not _FINISHED.is_set():
            why = "the torchrun agent stopped rank 0 (SIGTERM) after another rank exited; see the agent's log"
            written = _write(args, selection, results, cases[len(results):], why, locked=True)
            print(f"gradparity torchrun: {why}", flush=True)
            print_run_summary([r.record() for r in results] + [never_ran(c, why).record() for c in cases[len(results):]],
                              written, unmatched, stopped=why)
        sys.stdout.flush()
        os._exit(1)

    # A Python handler runs only between bytecodes of the main thread, and rank 0 may be blocked
    # in a collective with the rank that died (gloo waits out its timeout) past the agent's 30 s
    # grace, then SIGKILLed with no report. So the signal is blocked in this thread (and the
    # threads it starts later) and a thread of its own waits for it. A thread started before
    # (gloo's) may still take it: the Python handler then runs `stop` in a new thread, since the
    # main thread may hold the reports' lock.
    signal.signal(signal.SIGTERM, lambda signum, frame: threading.Thread(target=stop, daemon=True).start())
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait_for_sigterm() -> None:
        signal.sigwait({signal.SIGTERM})
        stop()

    threading.Thread(target=wait_for_sigterm, name="gradparity-sigterm", daemon=True).start()


def _exit_status(records: list[dict]) -> int:
    """`gradparity run`'s: 0 conformant, 1 a failure, 3 only infrastructure errors."""
    from conformance.judge.failure import EXIT_INFRASTRUCTURE_ONLY, only_infrastructure_errors

    if not records or any(r["verdict"] in ("failed", "xpassed") for r in records):
        return 1
    errors = [r for r in records if r["verdict"] == "error"]
    if errors and only_infrastructure_errors({"summary": {}, "results": records}):
        return EXIT_INFRASTRUCTURE_ONLY
    return 1 if errors else 0


def _progress(index: int, total: int, result: CaseResult) -> None:
    why = f": {result.failure.line()}" if result.failure is not None else ""
    if result.verdict == "skipped":
        why = f": {result.message}"
    print(f"[{index + 1}/{total}] {result.verdict.upper():7} {result.case.id}{why}", flush=True)


def _write(args, selection, results: list[CaseResult], left: list[Case], broken: str, locked: bool = False) -> dict:
    """Every planned case is in the report: the ones not reached yet as errors that say why."""
    if not locked:
        with _REPORTING:
            return _write(args, selection, results, left, broken, locked=True)
    from conformance.report import write_reports

    why = broken or "the run stopped before this case (a rank aborted, or the torchrun agent ended the world)"
    records = [r.record() for r in results] + [never_ran(c, why).record() for c in left]
    info = dict(args.run_info, stopped=(why if left else None) or broken or None)
    return write_reports(args.report_dir, records, adapters=list(selection.specs), profile=selection.profile,
                         run_info=info)


if __name__ == "__main__":
    sys.exit(main())
