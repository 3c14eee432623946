"""Per-scenario harness overhead: warm rank pool vs a fresh world per scenario, side by side.

For each scenario, the scenario's own work is what the ranks report (adapter wrap + training,
the slower rank); overhead is the coordinator's wall time for the task minus that work
(task dispatch, pickling the per-step records, the consistency check, and for the
spawn-per-scenario mode: process start, `import torch`, rendezvous and teardown).

    python benchmarks/harness_overhead.py [--quick] [--adapter torch-ddp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from conformance import catalogue
from conformance.harness.pool import RankPool
from conformance.topology import choose_topology

TASK = "conformance.runners.ddp:run"


def own_work(outcome) -> float:
    return max(v["seconds"]["wrap"] + v["seconds"]["train"] for v in outcome.values.values())


def warm(scenarios, adapter, repeats):
    pool = RankPool(choose_topology(2, "cpu"))
    pool.start()
    pool.run(TASK, (scenarios[0], adapter), timeout=120)  # warm-up: imports, first DDP
    rows = []
    for _ in range(repeats):
        for s in scenarios:
            t0 = time.perf_counter()
            outcome = pool.run(TASK, (s, adapter), timeout=120)
            wall = time.perf_counter() - t0
            assert outcome.ok, outcome.render_failures()
            rows.append((s.id, wall, own_work(outcome)))
    echo = []
    for i in range(50):
        t0 = time.perf_counter()
        pool.run("conformance.harness.probes:echo", i, timeout=60)
        echo.append(time.perf_counter() - t0)
    pool.close()
    return rows, statistics.median(echo)


def cold(scenarios, adapter):
    rows = []
    for s in scenarios:
        t0 = time.perf_counter()
        pool = RankPool(choose_topology(2, "cpu"))
        outcome = pool.run(TASK, (s, adapter), timeout=120)
        pool.close()
        wall = time.perf_counter() - t0
        assert outcome.ok, outcome.render_failures()
        rows.append((s.id, wall, own_work(outcome)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer scenarios and repeats")
    parser.add_argument("--adapter", default="torch-ddp")
    args = parser.parse_args()
    scenarios = [s for s in catalogue.select(area="ddp", profile="quick", world_sizes=[2]) if not s.upstream]
    scenarios = scenarios[:4] if args.quick else scenarios
    warm_rows, echo = warm(scenarios, args.adapter, 1 if args.quick else 3)
    cold_rows = cold(scenarios[: 3 if args.quick else 6], args.adapter)
    summary = {}
    for name, rows in (("warm pool", warm_rows), ("spawn per scenario", cold_rows)):
        overhead = [wall - work for _, wall, work in rows]
        summary[name] = {
            "scenarios": len(rows),
            "median_wall_ms": 1000 * statistics.median(w for _, w, _ in rows),
            "median_work_ms": 1000 * statistics.median(k for _, _, k in rows),
            "median_overhead_ms": 1000 * statistics.median(overhead),
            "max_overhead_ms": 1000 * max(overhead),
        }
    w, c = summary["warm pool"], summary["spawn per scenario"]
    print(f"{'mode':22} {'n':>4} {'wall ms':>10} {'work ms':>10} {'overhead ms':>12} {'max ovh ms':>11}")
    for name, r in summary.items():
        print(f"{name:22} {r['scenarios']:4d} {r['median_wall_ms']:10.1f} {r['median_work_ms']:10.1f} "
              f"{r['median_overhead_ms']:12.1f} {r['max_overhead_ms']:11.1f}")
    ratio = c["median_overhead_ms"] / max(w["median_overhead_ms"], 1e-9)
    print(f"empty task round trip (warm, 2 ranks): {1000 * echo:.2f} ms")
    print(f"overhead ratio spawn-per-scenario / warm pool: {ratio:.0f}x  (target: warm overhead <= 50 ms)")
    os.makedirs("benchmarks/results", exist_ok=True)
    out = {"adapter": args.adapter, "world_size": 2, "cpus": os.cpu_count(), "modes": summary,
           "echo_ms": 1000 * echo, "overhead_ratio": ratio}
    with open("benchmarks/results/harness_overhead.json", "w") as fh:
        json.dump(out, fh, indent=2)
    print("wrote benchmarks/results/harness_overhead.json")


if __name__ == "__main__":
    main()
