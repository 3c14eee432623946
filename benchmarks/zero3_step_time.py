"""refimpl's ZeRO-3 next to FSDP2's ``fully_shard``: step time and peak memory, one run.

    python benchmarks/zero3_step_time.py            # ~2 min on 2 CPU cores
    python benchmarks/zero3_step_time.py --quick    # smoke run

Model: 8 blocks of (Linear 512x512, ReLU, Linear 512x512), each block a unit of its own,
AdamW (optimizer state sharded by both). Both engines reshard a block after its forward.

Timing: one gloo world of 2 ranks; FSDP2 and refimpl wrap copies of the same model and take
turns step by step (the order flips every round) so that machine noise hits both alike; each
reports the median step (zero_grad + forward + backward + step). Memory: a fresh world per
engine, since peak RSS (VmHWM) is per process; reported as the peak growth over the RSS
measured just before the model was built, median over ranks. Ratios are refimpl / FSDP2
(goal: <= 1.1x time, <= 1.0x memory). Results: ``benchmarks/results/zero3_step_time.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "zero3_step_time.json"
TIMEOUT = timedelta(seconds=300)
D, BLOCKS, BATCH = 512, 8, 32


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D)) for _ in range(BLOCKS)])


def wrap(impl: str, model: nn.Module):
    """(module to call, optimizer) for one engine; every block a unit, resharded after forward."""
    if impl == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    from refimpl.sharded import FullyShardedDataParallel

    z3 = FullyShardedDataParallel(model, units=list(model), broadcast_buffers=False)
    return z3, z3.make_optimizer(torch.optim.AdamW, lr=1e-3)


def step(model, opt, batch) -> None:
    opt.zero_grad(set_to_none=True)
    model(batch).pow(2).mean().backward()
    opt.step()


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def timing_body(rank, world, steps, warmup, rounds, out_path):
    engines = {impl: wrap(impl, build()) for impl in ("fsdp2", "refimpl")}
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(BATCH, D, generator=g) for _ in range(4)]
    for model, opt in engines.values():
        for i in range(warmup):
            step(model, opt, batches[i % 4])
    times = {k: [] for k in engines}
    for r in range(rounds):
        for i in range(steps):
            for impl in (list(engines) if r % 2 == 0 else list(reversed(engines))):
                model, opt = engines[impl]
                t0 = time.perf_counter()
                step(model, opt, batches[i % 4])
                times[impl].append(time.perf_counter() - t0)
    if rank == 0:
        Path(out_path).write_text(json.dumps({k: 1e3 * statistics.median(v) for k, v in times.items()}))


def memory_body(rank, world, impl, steps, out_path):
    import gc

    gc.collect()
    before = _rss_kb("VmRSS")
    model, opt = wrap(impl, build())
    built = (_rss_kb("VmHWM") - before) / 1024
    # Training's own peak: reset the high-water mark after construction (Linux: clear_refs 5),
    # so a construction-time copy (refimpl broadcasts rank 0's state; FSDP2 does not) is apart.
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    batch = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        step(model, opt, batch)
    Path(f"{out_path}.{rank}").write_text(json.dumps([built, (_rss_kb("VmHWM") - before) / 1024]))


def _entry(rank, world, store_path, body, args):
    from conformance.harness.network import join_local_group

    torch.set_num_threads(1)
    join_local_group(store_path, rank, world, timeout=TIMEOUT)
    try:
        body(rank, world, *args)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def run(body, world, *args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), body, args), nprocs=world,
                           start_method="spawn", join=True)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    world = 2
    steps, warmup, rounds = (3, 1, 2) if args.quick else (10, 3, 4)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "timing.json")
        run(timing_body, world, steps, warmup, rounds, out)
        ms = json.loads(Path(out).read_text())
        mem = {}
        for impl in ("fsdp2", "refimpl"):
            out = os.path.join(tmp, f"mem-{impl}")
            run(memory_body, world, impl, 3, out)
            peaks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
            mem[impl] = [statistics.median(p[i] for p in peaks) for i in (0, 1)]
    result = {
        "model": f"{BLOCKS} blocks of Linear({D},{D})+ReLU+Linear({D},{D}), AdamW, batch {BATCH}/rank",
        "world_size": world, "load_before": os.getloadavg()[0],
        "fsdp2_ms": ms["fsdp2"], "refimpl_ms": ms["refimpl"], "time_ratio": ms["refimpl"] / ms["fsdp2"],
        "fsdp2_construction_peak_mb": mem["fsdp2"][0], "refimpl_construction_peak_mb": mem["refimpl"][0],
        "fsdp2_training_peak_mb": mem["fsdp2"][1], "refimpl_training_peak_mb": mem["refimpl"][1],
        "memory_ratio": mem["refimpl"][1] / mem["fsdp2"][1],
        "construction_memory_ratio": mem["refimpl"][0] / mem["fsdp2"][0],
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
