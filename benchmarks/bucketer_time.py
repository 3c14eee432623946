"""Reduce-scatter bucketing, timed: bucketed vs unbucketed, refimpl vs FairScale.

World size 2, gloo on CPU, 127.0.0.1. Each repetition reduce-scatters the same 200 small
tensors (100..1000 float32 elements per chunk), then flushes and tears the buckets down (as
sharded data parallel does once per backward). Times are the slowest rank's, medians over the
repetitions. Rows:

  * unbucketed: refimpl's bucketer with ``bucket_cap_mb=0`` (one collective per tensor);
  * refimpl: ``refimpl.sharded.bucketer.ReduceScatterBucketer`` (default 25 MiB buckets);
  * fairscale: FairScale 0.4.13's ``ReduceScatterBucketer`` (skipped, with the reason, if it
    does not import).

Run: ``python benchmarks/bucketer_time.py [--quick]``. Writes
``benchmarks/results/bucketer_time.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
N_TENSORS = 200
RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "bucketer_time.json"


def _import_fairscale():
    """(class, version, None) or (None, None, reason).

    FairScale's bucketer calls the private ``dist._reduce_scatter_base`` with a 2-D
    ``(world_size, n)`` input by default, which gloo rejects ("outputShape[0] * worldSize ==
    inputShape[0]"). Its own switch ``ENABLE_NCCL_BASE_COLLECTIVES=0`` (read at import) makes
    it call the public list form ``dist.reduce_scatter`` instead, which gloo runs.
    """
    os.environ.setdefault("ENABLE_NCCL_BASE_COLLECTIVES", "0")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import fairscale
            try:
                from fairscale.internal.reduce_scatter_bucketer import ReduceScatterBucketer
            except ImportError:
                from fairscale.utils.reduce_scatter_bucketer import ReduceScatterBucketer
        return ReduceScatterBucketer, fairscale.__version__, None
    except Exception as e:  # noqa: BLE001 - any import failure is reported, not raised
        return None, None, f"{type(e).__name__}: {e}"


def _fairscale_bytes(bucketer) -> int:
    return sum(t.untyped_storage().nbytes() for b in bucketer.buckets.values()
               for t in (b.data, b.output_shard))


def _inputs(rank):
    g = torch.Generator().manual_seed(rank)
    return [[torch.randint(-8, 9, (100 + (i * 37) % 900,), generator=g).float()
             for _ in range(WORLD_SIZE)] for i in range(N_TENSORS)]


def _round(bucketer, group, inputs):
    """One round of all inputs; returns (slowest rank's seconds, results)."""
    outputs = []
    dist.barrier(group=group)
    start = time.perf_counter()
    for chunks in inputs:
        bucketer.reduce_scatter_async(chunks, group, outputs.append)
    bucketer.flush()
    bucketer.teardown()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item(), outputs


def _time_interleaved(bucketers, group, inputs, reps):
    """Median seconds per implementation. Rounds alternate between implementations so that
    load from other processes on the machine hits all of them alike; round 0 warms up."""
    times = {name: [] for name in bucketers}
    outputs = {}
    for rep in range(reps + 1):
        for name, bucketer in bucketers.items():
            elapsed, outputs[name] = _round(bucketer, group, inputs)
            if rep:
                times[name].append(elapsed)
    return {name: statistics.median(t) for name, t in times.items()}, outputs


def _rank(rank, out_dir, reps):
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # deprecation chatter from FairScale's private calls
    from conformance.harness.network import join_local_group

    # A FileStore in the private out_dir and gloo on loopback: no listener off loopback.
    join_local_group(os.path.join(out_dir, "store"), rank, WORLD_SIZE, timeout=datetime.timedelta(seconds=60))
    from refimpl.sharded.bucketer import ReduceScatterBucketer

    group = dist.group.WORLD
    inputs = _inputs(rank)
    want = [sum(_inputs(r)[i][rank] for r in range(WORLD_SIZE)) for i in range(N_TENSORS)]
    rows = {}

    bucketers = {"unbucketed": ReduceScatterBucketer(bucket_cap_mb=0),
                 "refimpl": ReduceScatterBucketer(bucket_cap_mb=25)}
    fs_cls, fs_version, fs_error = _import_fairscale()
    if fs_cls is not None:
        bucketers["fairscale"] = fs_cls(bucket_cap_mb=25)
    try:
        medians, outputs = _time_interleaved(bucketers, group, inputs, reps)
    except Exception as e:  # noqa: BLE001 - FairScale failing on this torch/gloo is a result
        if "fairscale" not in bucketers:
            raise
        fs_error = f"{type(e).__name__}: {e}"
        del bucketers["fairscale"]
        medians, outputs = _time_interleaved(bucketers, group, inputs, reps)
    for name, bucketer in bucketers.items():
        own = isinstance(bucketer, ReduceScatterBucketer)
        rows[name] = {
            "median_s": medians[name],
            "collectives_per_round": bucketer.num_collectives // (reps + 1) if own else None,
            "exact": all(map(torch.equal, outputs[name], want)),
            "bytes_after_teardown": bucketer.memory_bytes() if own else _fairscale_bytes(bucketer),
        }
    if rank == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"rows": rows, "fairscale_version": fs_version,
                       "fairscale_error": fs_error}, f)
    dist.barrier(group=group)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 repetitions instead of 30")
    args = parser.parse_args(argv)
    reps = 5 if args.quick else 30

    with tempfile.TemporaryDirectory(prefix="gradparity-bench-") as out_dir:  # private (0700)
        ctx = mp.start_processes(_rank, args=(out_dir, reps), nprocs=WORLD_SIZE,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + 600
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.terminate()
                print("benchmark timed out after 600 s", file=sys.stderr)
                return 1
        result = json.loads(pathlib.Path(out_dir, "result.json").read_text())

    rows = result["rows"]
    t_unb, t_ref = rows["unbucketed"]["median_s"], rows["refimpl"]["median_s"]
    report = {
        "benchmark": "bucketer_time", "schema": 1, "torch": torch.__version__,
        "backend": "gloo", "device": "cpu", "world_size": WORLD_SIZE, "n_tensors": N_TENSORS,
        "repetitions": reps, "quick": args.quick, "rows": rows,
        "ratio_unbucketed_over_bucketed": t_unb / t_ref,
        "fairscale_version": result["fairscale_version"],
        "fairscale_skipped_reason": result["fairscale_error"],
        "fairscale_env": {"ENABLE_NCCL_BASE_COLLECTIVES": "0"},
        "ratio_fairscale_over_refimpl": (rows["fairscale"]["median_s"] / t_ref
                                         if "fairscale" in rows else None),
    }
    print(f"reduce-scatter of {N_TENSORS} small float32 tensors, world size {WORLD_SIZE}, "
          f"gloo/cpu, torch {torch.__version__}, median of {reps} (slowest rank)")
    header = f"{'implementation':<24}{'median ms':>11}{'vs refimpl':>12}{'collectives':>13}" \
             f"{'exact':>7}{'bytes after teardown':>22}"
    print(header)
    print("-" * len(header))
    names = {"unbucketed": "unbucketed (cap=0)", "refimpl": "refimpl bucketed (25MB)",
             "fairscale": f"fairscale {result['fairscale_version']} (25MB)"}
    for key in ("unbucketed", "refimpl", "fairscale"):
        if key not in rows:
            print(f"{names[key] if key != 'fairscale' else 'fairscale':<24} skipped: "
                  f"{result['fairscale_error']}")
            continue
        r = rows[key]
        coll = "-" if r["collectives_per_round"] is None else str(r["collectives_per_round"])
        print(f"{names[key]:<24}{r['median_s'] * 1e3:>11.2f}{r['median_s'] / t_ref:>11.2f}x"
              f"{coll:>13}{str(r['exact']):>7}{r['bytes_after_teardown']:>22}")
    print(f"bucketed speed-up over unbucketed: {t_unb / t_ref:.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"wrote {RESULTS}")
    ok = rows["refimpl"]["bytes_after_teardown"] == 0 and rows["refimpl"]["exact"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
