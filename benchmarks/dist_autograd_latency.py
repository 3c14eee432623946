"""Backward latency of refimpl's distributed autograd vs torch.distributed.autograd (CPU).

    python benchmarks/dist_autograd_latency.py            # full run
    python benchmarks/dist_autograd_latency.py --quick    # smoke run (seconds)

Four RPC workers (TensorPipe pinned to the loopback interface, rendezvous through a ``file://``
store in a private temp dir, one intra-op thread each). Both engines run in the
same processes, in the same run, interleaved iteration by iteration (or block by block) so that
machine noise hits both alike. Only the backward call is timed (forward untimed, then
``backward(context_id, [loss])``) except in ``ps-train-step``; each iteration opens a fresh
context.

- ``chain``: worker0 -> worker1 -> worker2 and back: x (requires grad) on worker0, a linear +
  tanh on each hop with that worker's own weight; loss on worker0. The backward crosses two
  RPC hops back and returns — 4 gradient messages and the completion chain.
- ``param-server``: worker0 holds the parameters; worker1 and worker2 are trainers running
  concurrently, each with a local layer, a call to the server, the loss locally. The latency
  of every trainer backward is collected (both trainers pooled).
- ``fan-out``: worker0 sends its activation to workers 1, 2 and 3 at once (``rpc_async``), each
  applies its layer, worker0 gathers and sums: the backward sends three gradient messages at
  once and waits for all.
- ``100-tensors``: worker0 -> worker1 -> worker0 with 100 small tensors (64 floats) per hop,
  each scaled by its own weight on worker1: per-tensor costs (send/recv records, packing).
- ``ps-train-step``: a whole training step of a parameter-server trainer (workers 1..3 at once,
  worker0 the server), timed end to end: fetch both parameters with ``to_here`` (recorded), a
  local forward, ``backward``, ``DistributedOptimizer.step``. refimpl fetches with its
  ``to_here(rref)`` (which the pre-fix refimpl also records) and torch with ``rref.to_here()``.

To measure an older refimpl, put its checkout first on
``PYTHONPATH`` and run this file (the workers inherit the path).

Reported: median and p90 in milliseconds per (pattern, engine), and the ratios refimpl / torch
of the medians and of the p90s. Writes a table to stdout and JSON to
benchmarks/results/dist_autograd_latency.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results" / "dist_autograd_latency.json"
STATE: dict = {}
WORLD_SIZE = 4


# worker-side functions (pickled by reference) ----------------------------------------------------
def _engine(mode):
    if mode == "refimpl":
        import refimpl.distributed_autograd as da

        return da.context, da.backward, da.rpc_sync
    import torch.distributed.autograd as tda
    from torch.distributed import rpc

    return tda.context, tda.backward, rpc.rpc_sync


def _engine_extras(mode):
    """(rpc_async, to_here(rref), DistributedOptimizer) of ``mode``."""
    if mode == "refimpl":
        import refimpl.distributed_autograd as da

        return da.rpc_async, da.to_here, da.DistributedOptimizer
    from torch.distributed import rpc
    from torch.distributed.optim import DistributedOptimizer

    return rpc.rpc_async, lambda rref: rref.to_here(), DistributedOptimizer


def _setup(dim: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    STATE["w"] = (torch.randn(dim, dim, generator=g) / dim**0.5).requires_grad_()
    STATE["b"] = torch.zeros(dim).requires_grad_()


def _layer(x):
    return torch.tanh(x @ STATE["w"] + STATE["b"])


def chain_hop(mode: str, x):
    """On worker1: a layer, then worker2's layer, then another layer here."""
    _, _, call = _engine(mode)
    h = _layer(x)
    return _layer(call("worker2", _layer, args=(h,)))


def _scale_each(xs):
    """On worker1 (100-tensors): each small tensor times its own weight."""
    return [x * w for x, w in zip(xs, STATE["small"], strict=True)]


def _setup_small(n: int, size: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    STATE["small"] = [torch.randn(size, generator=g).requires_grad_() for _ in range(n)]


def _ps_params():
    from torch.distributed import rpc

    return [rpc.RRef(STATE["w"]), rpc.RRef(STATE["b"])]


def ps_train_loop(mode: str, param_rrefs, batch: int, dim: int, warmup: int, repeats: int):
    """On a trainer: `repeats` timed training steps against the parameter server (worker0)."""
    context, backward, _ = _engine(mode)
    _, fetch, DistributedOptimizer = _engine_extras(mode)
    opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=1e-4)
    x = torch.randn(batch, dim)
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        with context() as cid:
            w, b = fetch(param_rrefs[0]), fetch(param_rrefs[1])
            loss = torch.tanh(x @ w + b).sum()
            backward(cid, [loss])
            opt.step(cid)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _median_p90(samples):
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, int(0.9 * len(s)))]


def trainer_loop(mode: str, batch: int, dim: int, warmup: int, repeats: int):
    """On a trainer: `repeats` timed backwards through the parameter server (worker0)."""
    context, backward, call = _engine(mode)
    x = torch.randn(batch, dim)
    times = []
    for i in range(warmup + repeats):
        with context() as cid:
            h = _layer(x)
            loss = call("worker0", _layer, args=(h,)).sum()
            t0 = time.perf_counter()
            backward(cid, [loss])
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return times


def _chain_once(mode: str, x):
    context, backward, call = _engine(mode)
    with context() as cid:
        y = call("worker1", chain_hop, args=(mode, _layer(x)))
        loss = y.sum()
        t0 = time.perf_counter()
        backward(cid, [loss])
        return time.perf_counter() - t0


def _fan_out_once(mode: str, x):
    context, backward, _ = _engine(mode)
    call_async, _, _ = _engine_extras(mode)
    with context() as cid:
        h = _layer(x)
        futs = [call_async(f"worker{r}", _layer, args=(h,)) for r in (1, 2, 3)]
        loss = sum(f.wait().sum() for f in futs)
        t0 = time.perf_counter()
        backward(cid, [loss])
        return time.perf_counter() - t0


def _small_once(mode: str, xs):
    context, backward, call = _engine(mode)
    with context() as cid:
        ys = call("worker1", _scale_each, args=([x * 2 for x in xs],))
        loss = torch.stack([y.sum() for y in ys]).sum()
        t0 = time.perf_counter()
        backward(cid, [loss])
        return time.perf_counter() - t0


def _interleaved(args, once, inputs):
    samples = {"refimpl": [], "torch": []}
    for i in range(args.warmup + args.repeats):
        for mode in ("refimpl", "torch") if i % 2 == 0 else ("torch", "refimpl"):
            t = once(mode, inputs)
            if i >= args.warmup:
                samples[mode].append(t)
    return samples


def _driver(args, world_size):
    from torch.distributed import rpc

    out = {}
    for r in range(world_size):
        rpc.rpc_sync(f"worker{r}", _setup, args=(args.dim, r))
        rpc.rpc_sync(f"worker{r}", _setup_small, args=(100, 64, r))
    # chain, engines interleaved
    x = torch.randn(args.batch, args.dim, requires_grad=True)
    chain = {"refimpl": [], "torch": []}
    for i in range(args.warmup + args.repeats):
        for mode in ("refimpl", "torch") if i % 2 == 0 else ("torch", "refimpl"):
            t = _chain_once(mode, x)
            if i >= args.warmup:
                chain[mode].append(t)
    out["chain"] = chain
    # parameter server: both trainers at once, engines alternating in blocks
    ps = {"refimpl": [], "torch": []}
    block = max(1, args.repeats // 4)
    for b in range(4):
        for mode in ("refimpl", "torch") if b % 2 == 0 else ("torch", "refimpl"):
            futs = [
                rpc.rpc_async(
                    f"worker{r}",
                    trainer_loop,
                    args=(mode, args.batch, args.dim, args.warmup if b == 0 else 1, block),
                )
                for r in (1, 2)
            ]
            for f in futs:
                ps[mode] += f.wait()
    out["param-server"] = ps
    out["fan-out"] = _interleaved(args, _fan_out_once, x)
    xs = [torch.randn(64, requires_grad=True) for _ in range(100)]
    out["100-tensors"] = _interleaved(args, _small_once, xs)
    # parameter-server training step: trainers 1..3 at once, engines alternating in blocks
    params = rpc.rpc_sync("worker0", _ps_params)
    train = {"refimpl": [], "torch": []}
    for b in range(4):
        for mode in ("refimpl", "torch") if b % 2 == 0 else ("torch", "refimpl"):
            futs = [
                rpc.rpc_async(
                    f"worker{r}",
                    ps_train_loop,
                    args=(mode, params, args.batch, args.dim, args.warmup if b == 0 else 1, block),
                )
                for r in (1, 2, 3)
            ]
            for f in futs:
                train[mode] += f.wait()
    out["ps-train-step"] = train
    return out


def init_worker(rank: int, world_size: int, store_path: str) -> None:
    """Join the benchmark's RPC world: loopback only, file rendezvous, one intra-op thread."""
    from conformance.harness.network import pin_to_loopback

    pin_to_loopback()  # before TensorPipe creates a transport
    torch.set_num_threads(1)
    from torch.distributed import rpc

    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"file://{store_path}",
        rpc_timeout=300,  # a loaded machine must not turn a slow RPC into a failure
        num_worker_threads=8,
        _transports=["uv"],
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)


def _worker(rank, world_size, store_path, args, queue):
    from torch.distributed import rpc

    init_worker(rank, world_size, store_path)
    try:
        if rank == 0:
            try:
                queue.put(("ok", _driver(args, world_size)))
            except BaseException:
                import traceback

                queue.put(("error", traceback.format_exc()))
                raise
    finally:
        # No timeout: the other workers wait here while worker0 measures (minutes), and a
        # timed-out all-gather would print tracebacks; the parent bounds the run instead.
        rpc.shutdown(graceful=True)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: few repeats")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    args.repeats = args.repeats if args.repeats is not None else (12 if args.quick else 100)

    tmp = tempfile.mkdtemp(prefix="dist-autograd-bench-")  # 0700: private
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker, args=(r, WORLD_SIZE, os.path.join(tmp, "rendezvous"), args, queue)
        )
        for r in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    try:
        status, raw = queue.get(timeout=3600)
        if status != "ok":
            raise SystemExit(f"the benchmark failed on worker0:\n{raw}")
    finally:
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    rows = []
    for pattern, by_engine in raw.items():
        stats = {}
        for engine, samples in by_engine.items():
            med, p90 = _median_p90(samples)
            stats[engine] = {"median_ms": med * 1e3, "p90_ms": p90 * 1e3, "n": len(samples)}
        rows.append(
            {
                "pattern": pattern,
                **{engine: v for engine, v in stats.items()},
                "ratio_median": stats["refimpl"]["median_ms"] / stats["torch"]["median_ms"],
                "ratio_p90": stats["refimpl"]["p90_ms"] / stats["torch"]["p90_ms"],
            }
        )

    header = f"{'pattern':<15}{'engine':<9}{'median ms':>11}{'p90 ms':>10}{'n':>6}{'ratio median':>14}{'ratio p90':>11}"
    print(header)
    print("-" * len(header))
    for row in rows:
        for engine in ("refimpl", "torch"):
            s = row[engine]
            ratio = f"{row['ratio_median']:.2f}x" if engine == "refimpl" else ""
            ratio90 = f"{row['ratio_p90']:.2f}x" if engine == "refimpl" else ""
            print(
                f"{row['pattern']:<15}{engine:<9}{s['median_ms']:>11.3f}{s['p90_ms']:>10.3f}"
                f"{s['n']:>6}{ratio:>14}{ratio90:>11}"
            )

    result = {
        "benchmark": "dist_autograd_latency",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "device": "cpu",
        "world_size": WORLD_SIZE,
        "batch": args.batch,
        "dim": args.dim,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "quick": args.quick,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
