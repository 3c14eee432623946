"""The engine compatibility matrix: the standard profile once per engine, timed, then docs/compatibility.md.

    python benchmarks/engine_matrix.py [--engines deepspeed-zero1 pfn-ddp ...] [-n 2] [--profile standard]
    python benchmarks/engine_matrix.py --rerun-failed   # after adding xfail entries for what it found

Each engine runs in its own `gradparity run` (so its wall time is its own); reports land in
reports/engines/<engine>/, the timings in benchmarks/results/engines.json, and the page is
written by `conformance.report.compatibility` from those reports. Engines that are not installed
show up as skipped with the install command.

`--rerun-failed` runs no matrix: it reruns each engine's failed (and errored, or unexpectedly
passed) cases of its last report, one engine at a time, after their xfail entries or suite fixes
are in, and writes the page with each rerun case at its rerun's verdict and a line per engine
saying how many were rerun and what they gave: the page says which verdicts came from where.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from conformance.adapters.registry import ENGINE_ADAPTERS
from conformance.report import compatibility


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=list(ENGINE_ADAPTERS))
    parser.add_argument("--profile", default="standard")
    parser.add_argument("-n", dest="workers", default="2")
    parser.add_argument("--out", default="docs/compatibility.md")
    parser.add_argument("--rerun-failed", action="store_true",
                        help="rerun each engine's failed cases of its last report and merge their verdicts into the page")
    args = parser.parse_args()
    unknown = [e for e in args.engines if e not in ENGINE_ADAPTERS]
    if unknown:
        print(f"engine_matrix: unknown engine(s) {unknown}; known: {', '.join(ENGINE_ADAPTERS)}", file=sys.stderr)
        return 2
    if args.rerun_failed:
        return rerun_failed(args)
    command = f"gradparity run --profile {args.profile} -n {args.workers} --adapter <engine> --report-dir reports/engines/<engine>"
    walls, paths = {}, []
    for engine in args.engines:
        report_dir = os.path.join("reports", "engines", engine)
        cmd = [sys.executable, "-m", "conformance.frontends.cli", "run", "--profile", args.profile, "-n", args.workers,
               "--adapter", engine, "--report-dir", report_dir]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        walls[engine] = time.perf_counter() - t0
        path = os.path.join(report_dir, "gradparity.json")
        if not os.path.exists(path):
            print(f"{engine}: no report written (exit {proc.returncode}):\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}",
                  file=sys.stderr)
            return 1
        summary = json.load(open(path))["summary"]  # noqa: SIM115
        paths.append(path)
        print(f"{engine:20} {walls[engine]:7.1f} s  exit {proc.returncode}  "
              + "  ".join(f"{k}={summary[k]}" for k in ("total", "passed", "failed", "xfailed", "skipped")), flush=True)
    os.makedirs("benchmarks/results", exist_ok=True)
    timings = {"command": command, "profile": args.profile, "workers": args.workers, "wall_s": walls}
    with open("benchmarks/results/engines.json", "w") as fh:
        json.dump(timings, fh, indent=2)
    reports = [json.load(open(p)) for p in paths]  # noqa: SIM115
    with open(args.out, "w") as fh:
        fh.write(compatibility.render(reports, timings))
    print(f"wrote {args.out}")
    return 0


BAD = ("failed", "error", "xpassed")


def rerun_failed(args) -> int:
    """Rerun every engine's failing cases of its last matrix report; the page from the merged reports."""
    with open("benchmarks/results/engines.json") as fh:
        timings = json.load(fh)
    reports, notes = [], []
    for engine in args.engines:
        path = os.path.join("reports", "engines", engine, "gradparity.json")
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            report = json.load(fh)
        bad = [r["scenario"] for r in report["results"] if r["verdict"] in BAD]
        if bad:
            rerun_dir = os.path.join("reports", "engines", engine, "rerun")
            cmd = [sys.executable, "-m", "conformance.frontends.cli", "run", "-n", args.workers, "--adapter", engine,
                   "--report-dir", rerun_dir]
            for sid in bad:
                cmd += ["--scenario", sid]
            subprocess.run(cmd, capture_output=True, text=True)
            with open(os.path.join(rerun_dir, "gradparity.json")) as fh:
                again = {r["scenario"]: r for r in json.load(fh)["results"]}
            report["results"] = [again.get(r["scenario"], r) if r["verdict"] in BAD else r for r in report["results"]]
            got = {v: sum(again[s]["verdict"] == v for s in bad if s in again) for v in ("xfailed", "skipped", "passed", *BAD)}
            notes.append(f"{engine}: {len(bad)} failing case(s) of the matrix run rerun after their xfail entries or "
                         "suite fixes: " + ", ".join(f"{n} {v}" for v, n in got.items() if n))
            print(notes[-1], flush=True)
        reports.append(report)
    timings["notes"] = [n for n in timings.get("notes", []) if "failing case(s) of the matrix run rerun" not in n] + notes
    with open(args.out, "w") as fh:
        fh.write(compatibility.render(reports, timings))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
