"""The rank loop under `torchrun` (multi-node): rank 0 coordinates, every rank serves.

    torchrun --nnodes 2 --nproc-per-node 4 ... -m conformance.harness.torchrun \\
        --adapter torch-ddp --profile standard --report-dir reports/multinode

Network: unlike the local pool (loopback only, harness/network.py), this keeps torch's
behaviour on purpose: the rendezvous (torchrun's TCPStore on MASTER_ADDR:MASTER_PORT, which
listens on every interface) and gloo's pairs (the interface the hostname resolves to, or
GLOO_SOCKET_IFNAME) must be reachable from the other nodes.

Unlike the warm pool, a multi-node world cannot be respawned by the coordinator, so a hang
or crash is bounded by the process group's timeout (`--timeout`), reported as a failure for
that scenario, and ends the run (exit status 1). Scenarios whose world size differs from the
torchrun world are not selected. Only areas whose driver exposes `TASK` and `judge` (ddp,
sharded) run here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from conformance import catalogue
from conformance.adapters import registry
from conformance.expectations import builtin_xfails, read_expectations
from conformance.failure import classify_exception
from conformance.harness.context import RankContext, Topology, configure_rank_threads, resolve
from conformance.harness.pool import RankFailure, TaskOutcome
from conformance.report.record import case_id, case_record


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m conformance.harness.torchrun")
    p.add_argument("--adapter", action="append", default=[])
    p.add_argument("--ddp-class", action="append", default=[])
    p.add_argument("--profile", default="quick", choices=catalogue.PROFILES)
    p.add_argument("--scenario", action="append", default=[])
    p.add_argument("--area", action="append", default=[], help="areas to run (default: those that can run here)")
    p.add_argument("--report-dir", default="gradparity-reports")
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds")
    return p


def _run_local(fn_ref: str, payload, ctx) -> dict:
    """Run the task on this rank; package the answer like the pool's service does."""
    try:
        return {"ok": True, "value": resolve(fn_ref)(payload, ctx)}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    specs = list(args.adapter) + [registry.ddp_class_spec(c) for c in args.ddp_class]
    specs = specs or list(registry.DEFAULT_ADAPTERS)
    try:
        adapters = {spec: registry.load(spec) for spec in specs}
    except registry.AdapterError as exc:
        print(f"gradparity: error: {exc}", file=sys.stderr)
        return 2

    configure_rank_threads()
    device = "cuda" if torch.cuda.is_available() and os.environ.get("GRADPARITY_DEVICE", "cuda") == "cuda" else "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout))
    topology = Topology(world, backend, device)
    ctx = RankContext(rank, topology, dist.group.WORLD)

    plan = []
    if rank == 0:
        for scenario in catalogue.select(profile=args.profile, world_sizes=[world], device=device, ids=args.scenario):
            driver = catalogue.driver(scenario.area)
            if args.area and scenario.area not in args.area or not hasattr(driver, "judge"):
                continue
            for spec, adapter in adapters.items():
                if adapter.area == scenario.area and not (set(scenario.requires) - set(adapter.capabilities)):
                    plan.append((scenario, spec))
        print(f"gradparity torchrun: world {world} ({backend}/{device}), {len(plan)} cases", flush=True)
    box = [plan]
    dist.broadcast_object_list(box, src=0, group=control)
    plan = box[0]

    xfails = {}
    for adapter in adapters.values():
        path = builtin_xfails(adapter.name)
        xfails.update(read_expectations(path) if path else {})
    results, failed = [], False
    for index, (scenario, spec) in enumerate(plan):
        driver = catalogue.driver(scenario.area)
        start = time.perf_counter()
        answer = _run_local(driver.TASK, (scenario, spec), ctx)
        gathered = [None] * world if rank == 0 else None
        try:
            dist.gather_object(answer, gathered, dst=0, group=control)
        except Exception as exc:  # a rank died or hung past the group timeout
            gathered = None
            error = f"{type(exc).__name__}: {exc}"
        if rank != 0:
            continue
        outcome = TaskOutcome(f"{scenario.id} with {spec}")
        if gathered is None:
            # A peer that died closes its connections; one that hangs lets the group time out.
            died = any(w in error.lower() for w in ("connection closed", "reset by peer", "broken pipe"))
            outcome.failures[0] = RankFailure(0, "died" if died else "timeout", f"gathering results failed: {error}")
        else:
            for r, a in enumerate(gathered):
                if a is None:
                    outcome.failures[r] = RankFailure(r, "no-answer", "no result")
                elif a["ok"]:
                    outcome.values[r] = a["value"]
                else:
                    outcome.failures[r] = RankFailure(r, "raised", a["error"], a["traceback"])
        outcome.seconds = time.perf_counter() - start
        failure = None
        try:
            checked = driver.judge(scenario, spec, outcome, where=f"torchrun world {world}")
            verdict, message = "passed", ""
        except Exception as exc:  # noqa: BLE001 - classified: a harness bug is an `error`, not a crash of the run
            failure = classify_exception(exc)
            checked, verdict, message = None, failure.failure_class.verdict, str(exc)
        case = case_id(spec, scenario)
        if case in xfails and verdict != "error":  # a known upstream bug: recorded, and a pass is news (strict)
            verdict, message = ("xfailed", xfails[case]) if verdict == "failed" else ("xpassed", "listed as xfail but passed")
        failed = failed or verdict in ("failed", "error", "xpassed")
        results.append(case_record(spec, scenario, verdict=verdict, message=message, duration_s=outcome.seconds,
                                   checked=checked, failure=failure))
        why = f": {failure.line()}" if failure is not None else ""
        print(f"[{index + 1}/{len(plan)}] {verdict.upper():6} {spec}|{scenario.id}{why}", flush=True)
        if gathered is None:
            break  # the world is broken and cannot be respawned from here
    if rank == 0:
        from conformance.report import write_reports

        paths = write_reports(args.report_dir, results, adapters=specs, profile=args.profile)
        print(f"gradparity torchrun: {sum(r['verdict'] == 'passed' for r in results)}/{len(results)} passed; "
              f"report {paths['json']}", flush=True)
    dist.destroy_process_group()
    return 1 if failed or (rank == 0 and not results) else 0


if __name__ == "__main__":
    sys.exit(main())
