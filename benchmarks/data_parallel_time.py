"""Forward+backward time of refimpl's data_parallel vs the unreplicated module (and torch's).

    python benchmarks/data_parallel_time.py            # full run
    python benchmarks/data_parallel_time.py --quick    # smoke run (seconds)

What is measured: one training step without the optimizer - forward, a mean-square loss,
backward, gradients reset to None - as the median of `--repeats` timed runs after
`--warmup` untimed ones.
- CPU: `data_parallel(model, x, ["cpu"] * N)` for N in {1, 2, 4} against `model(x)` on the
  CPU. The ratio (data_parallel / plain) is the engine's overhead: replication, scatter,
  threads, gather and the reduce-add of the gradients. N = 1 takes the single-device
  shortcut. On a CPU the replicas share the same cores, so a ratio below 1 is not
  expected; the point is how much the machinery costs.
- CUDA (when available): refimpl vs `torch.nn.DataParallel` on the same GPUs, and the plain
  module on the first GPU. Skipped with a printed reason otherwise.

Writes a table to stdout and JSON to benchmarks/results/data_parallel_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from refimpl.data_parallel import data_parallel

RESULTS = Path(__file__).resolve().parent / "results" / "data_parallel_time.json"


class ConvBN(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10),
        )

    def forward(self, x):
        return self.body(x)


def models(quick: bool):
    """(name, module, input batch) - small enough to run on a laptop CPU."""
    batch = 64 if quick else 256
    mlp = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    conv = ConvBN(16 if quick else 32).eval()  # BatchNorm in eval mode: stats are fixed
    return [
        ("mlp-256x1024x1024x10", mlp, torch.randn(batch, 256)),
        ("convbn-32x32", conv, torch.randn(batch // 4, 3, 32, 32)),
    ]


def time_steps(fns: dict, model: nn.Module, warmup: int, repeats: int, sync=lambda: None) -> dict:
    """Median seconds per variant. Variants are *interleaved* round by round, so a load
    spike from other processes on a shared machine hits the baseline and every variant
    alike instead of biasing whichever happened to run during it."""

    def step(fn):
        out = fn()
        out.float().square().mean().backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(warmup):
        for fn in fns.values():
            step(fn)
    sync()
    samples: dict = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            step(fn)
            sync()
            samples[key].append(time.perf_counter() - t0)
    return {key: statistics.median(v) for key, v in samples.items()}


def bench_cpu(quick: bool, warmup: int, repeats: int) -> list[dict]:
    rows = []
    for name, model, x in models(quick):
        fns = {"plain": lambda model=model, x=x: model(x)}
        for n in (1, 2, 4):
            fns[n] = lambda model=model, x=x, devices=["cpu"] * n: data_parallel(model, x, devices)
        t = time_steps(fns, model, warmup, repeats)
        for n in (1, 2, 4):
            rows.append({
                "model": name, "device": "cpu", "replicas": n, "batch": x.shape[0],
                "impl": "refimpl", "baseline": "plain-cpu",
                "time_ms": t[n] * 1e3, "baseline_ms": t["plain"] * 1e3, "ratio": t[n] / t["plain"],
            })
    return rows


def bench_cuda(quick: bool, warmup: int, repeats: int) -> tuple[list[dict], str | None]:
    if not torch.cuda.is_available():
        return [], "CUDA is not available: torch.nn.DataParallel comparison skipped"
    n = torch.cuda.device_count()
    devices = list(range(n))
    rows = []
    for name, model, x in models(quick):
        model = model.cuda(0)
        x = x.cuda(0)
        torch_dp = nn.DataParallel(model, devices)
        t = time_steps(
            {
                "plain": lambda model=model, x=x: model(x),
                "torch": lambda torch_dp=torch_dp, x=x: torch_dp(x),
                "ours": lambda model=model, x=x: data_parallel(model, x, devices),
            },
            model, warmup, repeats, torch.cuda.synchronize,
        )
        plain, theirs, ours = t["plain"], t["torch"], t["ours"]
        for impl, t in (("refimpl", ours), ("torch.nn.DataParallel", theirs)):
            rows.append({
                "model": name, "device": "cuda", "replicas": n, "batch": x.shape[0],
                "impl": impl, "baseline": "torch.nn.DataParallel",
                "time_ms": t * 1e3, "baseline_ms": theirs * 1e3, "ratio": t / theirs,
                "plain_ms": plain * 1e3,
            })
    return rows, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small models, few repeats")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    repeats = args.repeats if args.repeats is not None else (5 if args.quick else 30)
    torch.manual_seed(0)

    rows = bench_cpu(args.quick, warmup, repeats)
    cuda_rows, skipped = bench_cuda(args.quick, warmup, repeats)
    rows += cuda_rows

    header = f"{'model':<22} {'device':<6} {'N':>2} {'batch':>5} {'impl':<22} {'time ms':>9} {'baseline':<22} {'base ms':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['model']:<22} {r['device']:<6} {r['replicas']:>2} {r['batch']:>5} {r['impl']:<22} "
            f"{r['time_ms']:>9.3f} {r['baseline']:<22} {r['baseline_ms']:>9.3f} {r['ratio']:>6.2f}"
        )
    if skipped:
        print(f"skipped: {skipped}")

    result = {
        "benchmark": "data_parallel_time",
        "quick": args.quick,
        "warmup": warmup,
        "repeats": repeats,
        "statistic": "median seconds of forward+backward, reported in ms",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "skipped": [skipped] if skipped else [],
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
