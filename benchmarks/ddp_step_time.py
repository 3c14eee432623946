"""Step time, overlap and peak memory: refimpl's DDP next to torch's, same model, same world.

    python benchmarks/ddp_step_time.py            # full run (~2 min on 2 CPU cores)
    python benchmarks/ddp_step_time.py --quick    # smoke run

Models: a 24-layer MLP, a 9-layer transformer, 150 tiny layers, and two production
setups: ``mlp-amp`` (a 12-layer MLP under ``torch.autocast`` bf16 with a ``GradScaler``) and
``mlp-ckpt`` (the MLP in 6 blocks under non-reentrant activation checkpointing).

Timing: one gloo world of 2 ranks per model; torch and refimpl wrap copies of the same
model and take turns (rounds of a few steps each) so that machine noise hits both alike;
each reports the median of its per-step times (zero_grad + forward + backward + SGD step)
after warm-up. Overlap: the share of communication time that ran before backward ended —
refimpl from ``get_backward_stats()``, torch from ``_get_ddp_logging_data()``
(``avg_backward_compute_comm_overlap_time / avg_backward_comm_time``, sampled by torch's
logger; reported as null where torch does not fill it). Memory: a fresh world per
(implementation, gradient_as_bucket_view) since VmHWM (peak RSS) is per process; reported
as the peak growth over the RSS measured just before the model was built. With
``gradient_as_bucket_view`` the gradients *are* the bucket buffers, so the peak should drop
by about one copy of the gradients.

Results go to ``benchmarks/results/ddp_step_time.json`` and are printed.
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
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "ddp_step_time.json"
TIMEOUT = timedelta(seconds=120)


# ---------------------------------------------------------------- models
class Transformer(nn.Module):
    def __init__(self, vocab=256, d=128, layers=9):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)))


class CheckpointedMLP(nn.Module):
    """The benchmark MLP in blocks, each recomputed in backward (non-reentrant checkpoint)."""

    def __init__(self, blocks=6, per_block=4, d=512):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(*[m for _ in range(per_block) for m in (nn.Linear(d, d), nn.ReLU())]) for _ in range(blocks)
        )

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def build(name: str):
    """Return (model, make_batch, loss) for one benchmark model."""
    if name == "mlp-amp":
        # A narrower MLP: bf16 matmuls on CPUs without bf16 units are several times slower
        # than fp32, and the ratio, not the size, is what is measured.
        model = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(256, 256), nn.ReLU())])
        return model, lambda g: torch.randn(32, 256, generator=g), lambda out: out.pow(2).mean()
    if name == "mlp-ckpt":
        return CheckpointedMLP(), lambda g: torch.randn(64, 512, generator=g), lambda out: out.pow(2).mean()
    if name == "mlp":
        layers = []
        for _ in range(24):
            layers += [nn.Linear(512, 512), nn.ReLU()]
        model = nn.Sequential(*layers)
        return model, lambda g: torch.randn(64, 512, generator=g), lambda out: out.pow(2).mean()
    if name == "transformer":
        model = Transformer()
        return (
            model,
            lambda g: torch.randint(0, 256, (8, 32), generator=g),
            lambda out: out.float().logsumexp(-1).mean(),
        )
    if name == "tiny":
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(150)])  # 300 tiny tensors
        return model, lambda g: torch.randn(16, 8, generator=g), lambda out: out.pow(2).mean()
    raise ValueError(name)


def wrap(impl: str, model: nn.Module, **kw):
    if impl == "torch":
        from torch.nn.parallel import DistributedDataParallel
    else:
        from refimpl import DistributedDataParallel
    return DistributedDataParallel(model, **kw)


def step(ddp, opt, batch, loss_fn, scaler=None):
    opt.zero_grad(set_to_none=True)
    if scaler is None:
        loss_fn(ddp(batch)).backward()
        opt.step()
        return
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(ddp(batch).float())
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


# ---------------------------------------------------------------- rank bodies
def timing_body(rank, world, model_name, steps, warmup, rounds, out_path):
    torch.manual_seed(0)
    model, make_batch, loss_fn = build(model_name)
    impls = {}
    for impl in ("torch", "refimpl"):
        torch.manual_seed(0)
        m, _, _ = build(model_name)
        ddp = wrap(impl, m)
        scaler = torch.amp.GradScaler("cpu") if model_name.endswith("-amp") else None
        impls[impl] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), scaler)
    g = torch.Generator().manual_seed(rank)
    batches = [make_batch(g) for _ in range(4)]
    times = {k: [] for k in impls}
    overlap = []
    for ddp, opt, scaler in impls.values():
        for i in range(warmup):
            step(ddp, opt, batches[i % 4], loss_fn, scaler)
    # Alternate implementations every step (and their order every round) so that load
    # from other processes on the machine hits both alike.
    for r in range(rounds):
        order = list(impls) if r % 2 == 0 else list(reversed(impls))
        for i in range(steps):
            for impl in order:
                ddp, opt, scaler = impls[impl]
                t0 = time.perf_counter()
                step(ddp, opt, batches[i % 4], loss_fn, scaler)
                times[impl].append(time.perf_counter() - t0)
                if impl == "refimpl":
                    overlap.append(ddp.get_backward_stats().overlap_fraction())
    torch_ddp = impls["torch"][0]
    logging = {}
    try:
        logging = torch_ddp._get_ddp_logging_data()
    except Exception:  # noqa: BLE001 - private API; absent on some versions
        pass
    comm = logging.get("avg_backward_comm_time") or 0
    ov = logging.get("avg_backward_compute_comm_overlap_time") or 0
    ref = impls["refimpl"][0]
    result = {
        "model": model_name,
        "param_tensors": len([p for p in model.parameters() if p.requires_grad]),
        "params": sum(p.numel() for p in model.parameters()),
        "torch_ms": 1e3 * statistics.median(times["torch"]),
        "refimpl_ms": 1e3 * statistics.median(times["refimpl"]),
        "refimpl_buckets": len(ref.bucket_plan),
        "refimpl_overlap": statistics.median(overlap) if overlap else None,
        "torch_overlap": (ov / comm) if comm else None,
        "torch_avg_backward_comm_time_ns": comm or None,
        "steps_per_impl": len(times["torch"]),
    }
    result["ratio"] = result["refimpl_ms"] / result["torch_ms"]
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))


def memory_body(rank, world, impl, as_view, model_name, steps, out_path):
    import gc

    gc.collect()
    before = _rss_kb("VmRSS")
    torch.manual_seed(0)
    model, make_batch, loss_fn = build(model_name)
    ddp = wrap(impl, model, gradient_as_bucket_view=as_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    batch = make_batch(g)
    for _ in range(steps):
        # set_to_none=False keeps the grads alive between steps, as most training loops do
        # with gradient_as_bucket_view; the peak then shows the bucket/grad sharing.
        opt.zero_grad(set_to_none=False)
        loss_fn(ddp(batch)).backward()
        opt.step()
    peak = _rss_kb("VmHWM")
    grads_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    if rank == 0:
        Path(out_path).write_text(json.dumps({"peak_growth_mb": (peak - before) / 1024, "grads_mb": grads_mb}))


# ---------------------------------------------------------------- worlds
def _entry(rank, world, store_path, body, args):
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT.parent))
    from conformance.harness.network import join_local_group

    join_local_group(store_path, rank, world, timeout=TIMEOUT)  # FileStore + gloo on loopback: no listener off it
    try:
        body(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_world(body, world, *args, timeout=900.0) -> dict:
    with tempfile.TemporaryDirectory(prefix="gradparity-bench-") as tmp:  # private (0700): the store lives here
        out = os.path.join(tmp, "result.json")
        ctx = mp.start_processes(
            _entry, args=(world, os.path.join(tmp, "store"), body, (*args, out)), nprocs=world, join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{body.__name__}{args} did not finish in {timeout}s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return json.loads(Path(out).read_text())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few steps, for a smoke run")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--models", default="mlp,transformer,tiny,mlp-amp,mlp-ckpt")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    steps, warmup, rounds, mem_steps = (3, 2, 2, 2) if args.quick else (10, 5, 6, 4)
    models = args.models.split(",")
    scale = {"mlp": 1, "transformer": 3, "tiny": 6, "mlp-amp": 1, "mlp-ckpt": 1}  # cheaper models get more samples
    rows = [run_world(timing_body, args.world_size, m, steps * scale.get(m, 1), warmup, rounds) for m in models]
    memory = {}
    mem_model = "mlp"
    for impl in ("torch", "refimpl"):
        for as_view in (False, True):
            memory[f"{impl}{'+view' if as_view else ''}"] = run_world(
                memory_body, args.world_size, impl, as_view, mem_model, mem_steps
            )
    result = {
        "benchmark": "ddp_step_time",
        "torch": torch.__version__,
        "backend": "gloo",
        "device": "cpu",
        "world_size": args.world_size,
        "threads_per_rank": 1,
        "quick": args.quick,
        "models": rows,
        "memory_model": mem_model,
        "memory": memory,
        "memory_ratio_refimpl_over_torch": memory["refimpl"]["peak_growth_mb"] / memory["torch"]["peak_growth_mb"],
        "memory_ratio_refimpl_view_over_torch_view": memory["refimpl+view"]["peak_growth_mb"]
        / memory["torch+view"]["peak_growth_mb"],
    }
    _print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


def _fmt(x, spec=".2f"):
    return "n/a" if x is None else format(x, spec)


def _print_table(r: dict) -> None:
    print(f"DDP step time, gloo CPU, world size {r['world_size']}, torch {r['torch']}")
    print(f"{'model':<12} {'tensors':>7} {'buckets':>7} {'torch ms':>9} {'refimpl ms':>10} {'ratio':>6} "
          f"{'overlap refimpl':>15} {'overlap torch':>13}")
    for m in r["models"]:
        print(f"{m['model']:<12} {m['param_tensors']:>7} {m['refimpl_buckets']:>7} {m['torch_ms']:>9.2f} "
              f"{m['refimpl_ms']:>10.2f} {m['ratio']:>6.3f} {_fmt(m['refimpl_overlap']):>15} "
              f"{_fmt(m['torch_overlap']):>13}")
    grads = r["memory"]["torch"]["grads_mb"]
    print(f"peak memory growth ({r['memory_model']}, gradients = {grads:.1f} MiB), MiB per rank:")
    for k, v in r["memory"].items():
        print(f"  {k:<14} {v['peak_growth_mb']:8.1f}")
    print(f"  ratio refimpl/torch: {r['memory_ratio_refimpl_over_torch']:.3f}   "
          f"with gradient_as_bucket_view: {r['memory_ratio_refimpl_view_over_torch_view']:.3f}")


if __name__ == "__main__":
    main()
