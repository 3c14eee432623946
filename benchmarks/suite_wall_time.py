"""Wall time of `gradparity run` per profile, with scenario counts; with `--before`, side by side.

    python benchmarks/suite_wall_time.py [--adapter torch-ddp] [--profiles quick standard] [-n 2]
    python benchmarks/suite_wall_time.py --before /path/to/old-venv/bin/python --rounds 2 \\
        --adapter refimpl-ddp --profiles standard -n 2

`--before` names an interpreter where another checkout of gradparity is installed (a commit to
compare with: `git worktree add /tmp/old <commit>`, then a venv with `pip install -c
constraints.txt -e /tmp/old[suite]`). Both run the same command in turns (before, after, before,
after ...), so a noisy machine slows both alike, and the ratio after/before is printed per round
and as the median: the figure an issue's budget names. With no `--adapter`, each side runs its
own default adapters (the README's main job).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def timed_run(python: str, profile: str, adapters: list[str], workers: str | None) -> dict:
    """One `gradparity run` with `python`: wall seconds, exit status and the report's summary."""
    with tempfile.TemporaryDirectory() as tmp:
        # the console script beside the interpreter: the module path of the CLI moved between versions
        cmd = [os.path.join(os.path.dirname(python), "gradparity"), "run", "--profile", profile, "--report-dir", tmp]
        for a in adapters:
            cmd += ["--adapter", a]
        if workers:
            cmd += ["-n", workers]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        wall = time.perf_counter() - t0
        report = os.path.join(tmp, "gradparity.json")
        if not os.path.exists(report):
            sys.exit(f"{python} {profile}: no report written (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        with open(report) as fh:
            summary = json.load(fh)["summary"]
    return {"wall_s": wall, "exit": proc.returncode, **summary}


def _line(label: str, profile: str, r: dict) -> str:
    counts = "  ".join(f"{k}={r.get(k)}" for k in ("total", "passed", "failed", "xfailed", "skipped"))
    return f"{label:7} {profile:9} {r['wall_s']:7.1f} s  exit {r['exit']}  {counts}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapter", action="append", default=None)
    parser.add_argument("--profiles", nargs="+", default=["quick", "standard"])
    parser.add_argument("-n", dest="workers", default=None)
    parser.add_argument("--before", help="an interpreter with the checkout to compare with installed")
    parser.add_argument("--rounds", type=int, default=1, help="turns of before/after (with --before)")
    args = parser.parse_args()
    adapters = args.adapter or ([] if args.before else ["torch-ddp"])
    sides = [("before", args.before), ("after", sys.executable)] if args.before else [("run", sys.executable)]
    rows = []
    for profile in args.profiles:
        ratios = []
        for k in range(args.rounds if args.before else 1):
            walls = {}
            for label, python in sides:
                r = timed_run(python, profile, adapters, args.workers)
                walls[label] = r["wall_s"]
                rows.append({"profile": profile, "side": label, "round": k, "adapters": adapters,
                             "workers": args.workers or 0, **r})
                print(_line(label, profile, r), flush=True)
            if args.before:
                ratios.append(walls["after"] / walls["before"])
                print(f"round {k}: after/before = {ratios[-1]:.2f}x", flush=True)
        if ratios:
            print(f"{profile}: median after/before over {len(ratios)} round(s) = {statistics.median(ratios):.2f}x",
                  flush=True)
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/suite_wall_time.json", "w") as fh:
        json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
