"""Soak: does the suite stay right on a loaded machine? False failures (target 0) and the
loaded/idle wall-time ratio, measured side by side in one run.

    python benchmarks/soak.py                       # standard profile, torch-ddp + refimpl-ddp, 3 loaded rounds
    python benchmarks/soak.py --quick               # quick profile, 1 loaded round (a smoke run)
    python benchmarks/soak.py --tests               # also the README's test command (pytest tests -n 2) under load
    python benchmarks/soak.py --profile full --adapter refimpl-zero3 --adapter torch-fsdp2 -k w8   # 8-rank pools

Both adapters are correct engines and their known upstream failures are strict xfails, so every
`failed`, `error` or `xpassed` case is a *false failure*: the harness mistook load for a bug.
The load generator (started and stopped here) keeps 2 x cores busy processes spinning for
the whole of each loaded round; the idle round runs first, without it. The machine may be
shared, so "idle" means "without our load": compare the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

ADAPTERS = ("torch-ddp", "refimpl-ddp")
BAD = ("failed", "error", "xpassed")


def _spin(stop) -> None:
    """One busy process: pure CPU until told to stop."""
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


class Load:
    """`count` busy processes for the duration of a `with` block (always stopped and reaped)."""

    def __init__(self, count: int):
        self.count, self.procs = count, []
        self.stop = mp.get_context("spawn").Event()

    def __enter__(self):
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_spin, args=(self.stop,), daemon=True) for _ in range(self.count)]
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        return False


def run_suite(profile: str, adapters, workers: str | None, keyword: str | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="gradparity-soak-") as tmp:
        cmd = [sys.executable, "-m", "conformance.frontends.cli", "run", "--profile", profile, "--report-dir", tmp]
        for a in adapters:
            cmd += ["--adapter", a]
        if workers:
            cmd += ["-n", workers]
        if keyword:
            cmd += ["-k", keyword]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        path = os.path.join(tmp, "gradparity.json")
        if not os.path.exists(path):  # no report is itself a false failure of the whole round
            return {"wall_s": wall, "exit": proc.returncode, "total": 0, "false": [f"no report: {proc.stderr[-500:]}"]}
        with open(path) as fh:
            report = json.load(fh)
    false = [f"{r['case']}: {r['verdict']} [{r.get('failure_class') or '-'}] {r.get('cause') or ''}"
             for r in report["results"] if r["verdict"] in BAD]
    s = report["summary"]
    return {"wall_s": wall, "exit": proc.returncode, "total": s["total"], "passed": s["passed"],
            "xfailed": s["xfailed"], "skipped": s["skipped"], "false": false}


def run_tests(workers: str) -> dict:
    cmd = [sys.executable, "-m", "pytest", "tests", "-n", workers, "--dist", "loadgroup", "-q", "-p", "no:cacheprovider"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1:] or [""]
    return {"wall_s": time.perf_counter() - t0, "exit": proc.returncode, "summary": tail[0],
            "false": [] if proc.returncode == 0 else [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="standard")
    parser.add_argument("--rounds", type=int, default=3, help="loaded rounds (default 3)")
    parser.add_argument("--adapter", action="append", default=None, help=f"default: {', '.join(ADAPTERS)}")
    parser.add_argument("-n", dest="workers", default=None, help="pytest-xdist workers for the suite")
    parser.add_argument("--load", type=int, default=2 * (os.cpu_count() or 1), help="busy processes (default 2 x cores)")
    parser.add_argument("--tests", action="store_true", help="also run `pytest tests -n 2 --dist loadgroup` under load")
    parser.add_argument("--quick", action="store_true", help="quick profile, one loaded round")
    parser.add_argument("-k", dest="keyword", default=None, help="only cases matching this pytest -k expression")
    args = parser.parse_args()
    if args.quick:
        args.profile, args.rounds = "quick", 1
    adapters = args.adapter or list(ADAPTERS)

    rows = []

    def report(label, row):
        rows.append({"round": label, **row})
        print(f"{label:10} {row['wall_s']:7.1f} s  exit {row['exit']}  cases {row.get('total', '-')}  "
              f"false failures {len(row['false'])}", flush=True)
        for line in row["false"]:
            print(f"    FALSE FAILURE {line}", flush=True)

    print(f"soak: profile {args.profile}{f' -k {args.keyword!r}' if args.keyword else ''}, adapters {', '.join(adapters)}, load {args.load} busy processes on "
          f"{os.cpu_count()} cores, {args.rounds} loaded round(s)", flush=True)
    idle = run_suite(args.profile, adapters, args.workers, args.keyword)
    report("idle", idle)
    loaded = []
    for i in range(args.rounds):
        with Load(args.load):
            loaded.append(run_suite(args.profile, adapters, args.workers, args.keyword))
        report(f"loaded {i + 1}", loaded[-1])
    tests = None
    if args.tests:
        with Load(args.load):
            tests = run_tests("2")
        report("tests+load", tests)
        print(f"    {tests['summary']}", flush=True)

    false = sum(len(r["false"]) for r in [idle, *loaded]) + (len(tests["false"]) if tests else 0)
    mean_loaded = sum(r["wall_s"] for r in loaded) / len(loaded)
    ratio = mean_loaded / idle["wall_s"]
    print("\n| profile | adapters | load | rounds | cases/round | false failures | idle s | loaded s (mean) | loaded/idle |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.profile} | {', '.join(adapters)} | {args.load} busy procs / {os.cpu_count()} cores | 1 idle + "
          f"{args.rounds} loaded | {idle.get('total', 0)} | {false} | {idle['wall_s']:.1f} | {mean_loaded:.1f} | {ratio:.2f} |")
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/soak.json", "w") as fh:
        json.dump({"profile": args.profile, "adapters": adapters, "load": args.load, "cores": os.cpu_count(),
                   "rounds": rows, "false_failures": false, "loaded_over_idle": ratio}, fh, indent=2)
    return 1 if false else 0


if __name__ == "__main__":
    sys.exit(main())
