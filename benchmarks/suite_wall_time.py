"""Wall time of `gradparity run` per profile (one adapter), with scenario counts.

    python benchmarks/suite_wall_time.py [--adapter torch-ddp] [--profiles quick standard] [-n 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapter", action="append", default=None)
    parser.add_argument("--profiles", nargs="+", default=["quick", "standard"])
    parser.add_argument("-n", dest="workers", default=None)
    args = parser.parse_args()
    adapters = args.adapter or ["torch-ddp"]
    rows = []
    for profile in args.profiles:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "conformance.frontends.cli", "run", "--profile", profile, "--report-dir", tmp]
            for a in adapters:
                cmd += ["--adapter", a]
            if args.workers:
                cmd += ["-n", args.workers]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if not os.path.exists(os.path.join(tmp, "gradparity.json")):
                sys.exit(f"{profile}: no report written (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
            with open(os.path.join(tmp, "gradparity.json")) as fh:
                summary = json.load(fh)["summary"]
        rows.append({"profile": profile, "adapters": adapters, "workers": args.workers or 0, "wall_s": wall,
                     "exit": proc.returncode, **summary})
        print(f"{profile:9} {','.join(adapters):30} -n {args.workers or 0}: {wall:6.1f} s  exit {proc.returncode}  "
              + "  ".join(f"{k}={summary[k]}" for k in ("total", "passed", "failed", "xfailed", "skipped")), flush=True)
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/suite_wall_time.json", "w") as fh:
        json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
