"""Where refimpl's distributed backward spends its time on the 3-worker chain (CPU).

    python benchmarks/dist_autograd_profile.py [--repeats 200]

The chain of ``dist_autograd_latency.py`` (worker0 -> worker1 -> worker2 -> worker1 -> worker0,
a linear + tanh per hop). On every worker the engine's stages are wrapped with timers (the
wrappers add a few microseconds per call); worker0 also times the whole ``backward``. Printed
per stage: total milliseconds per backward, summed over the workers, and calls per backward.
Alongside, on the same workers and in the same run:

- ``rpc no-op x2 hops``: the messaging floor: an ``async_execution`` no-op on worker1 that
  forwards to worker2 (the shape of the backward's gradient messages, without graph work);
- ``torch backward``: torch.distributed.autograd's backward of the same chain;
- ``python-rpc floor``: what any engine written over torch's Python RPC pays at least on this
  chain: ``4 one-way hops`` (the backward's four gradient messages w0 -> w1 -> w2 -> w1 -> w0 as
  Python-function RPCs carrying the 32x256 gradient, each hop sending the next before it
  returns, no graph work) plus ``local compute`` (plain ``torch.autograd.backward`` of the
  same four layers in one process). Its ratio to torch's backward is the best a Python engine
  on this transport can show here.

- ``4 hops on the channel`` / ``channel floor``: the same four messages on refimpl's gradient
  channel (refimpl/distributed_autograd/channel.py), which refimpl's backward uses: the floor of
  this engine as built.
- ``cpu / backward``: CPU seconds (all threads) the three workers spend on one backward, for
  each engine; ``100-tensors cpu / backward`` the same for that pattern of the latency
  benchmark. Unlike the wall times, this figure holds on a loaded machine (waiting for a core is
  not counted), so it compares the engines' work where the latency ratios are noise.

Stages: ``walk`` (finding the leaves and recv nodes), ``autograd`` (torch.autograd.backward of
the local part, hooks included), ``accumulate`` (own buffers + sum into the context),
``send on`` (sending a run's gradient messages, or handing its credit back; not waiting), ``end-pass`` (sending
the graph releases), ``local run`` (a whole local run: walk, hook registration, autograd,
accumulate). What the stages do not cover is messaging: serialization, the agent's threads
and the futures' callbacks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_autograd_latency as lat  # noqa: E402

TIMES: dict[str, list[float]] = defaultdict(list)


def _wrap(module, name: str, stage: str) -> None:
    fn = getattr(module, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[stage].append(time.perf_counter() - t0)

    timed.__wrapped__ = fn
    setattr(module, name, timed)


def _engine_part(new: str, old: str):
    """(module, name) of an engine function: its module since the engine's split, or engine.py's
    private name in an older refimpl on PYTHONPATH (before/after tables)."""
    import importlib

    module, _, name = new.partition(":")
    try:
        found = importlib.import_module(f"refimpl.distributed_autograd.{module}")
    except ImportError:
        found = None
    if found is not None and hasattr(found, name):
        return found, name
    return importlib.import_module("refimpl.distributed_autograd.engine"), old


def instrument() -> None:
    from refimpl.distributed_autograd import engine, lifetime
    from refimpl.distributed_autograd.context import DistAutogradContext

    _wrap(*_engine_part("local_run:collect_leaves", "_collect_leaves"), "walk")
    _wrap(*_engine_part("local_run:_autograd_run", "_autograd_run"), "autograd")
    if hasattr(engine, "_autograd_grad"):  # refimpl before the two runs were one function
        _wrap(engine, "_autograd_grad", "autograd")
    _wrap(*_engine_part("local_run:own_buffers", "_own_buffers"), "accumulate")
    if hasattr(DistAutogradContext, "accumulate_all"):
        _wrap(DistAutogradContext, "accumulate_all", "accumulate")
    else:  # an older refimpl on PYTHONPATH (before/after tables)
        _wrap(DistAutogradContext, "accumulate", "accumulate")
    _wrap(*_engine_part("local_run:run_local", "_run_local"), "local run (all above + hooks)")
    _wrap(*_engine_part("gradient_messages:send_on", "_send_on"), "send on")
    _wrap(lifetime, "end_pass_on", "end-pass")


def reset() -> None:
    TIMES.clear()


def collect() -> dict[str, tuple[float, int]]:
    return {k: (sum(v), len(v)) for k, v in TIMES.items()}


def cpu_seconds() -> float:
    """This worker's CPU time, all its threads."""
    return time.process_time()


def _cpu_snapshot() -> list[float]:
    from torch.distributed import rpc

    futs = [rpc.rpc_async(f"worker{r}", cpu_seconds) for r in (1, 2)]
    return [time.process_time()] + [f.wait() for f in futs]


def _cpu_of_backward(mode: str, x) -> list[float] | None:
    """CPU seconds each worker spends on one chain backward (``mode`` None: nothing between
    the snapshots, the cost of taking them). Load-robust where wall time is not: time spent
    waiting for a core is not counted. ``x`` a list of tensors: the 100-tensors pattern of
    ``dist_autograd_latency.py`` instead (worker0 -> worker1 -> worker0, 100 small tensors)."""
    context, backward, call = lat._engine(mode or "torch")
    with context() as cid:
        if isinstance(x, list):
            ys = call("worker1", lat._scale_each, args=([t * 2 for t in x],))
            loss = torch.stack([y.sum() for y in ys]).sum()
        else:
            loss = call("worker1", lat.chain_hop, args=(mode or "torch", lat._layer(x))).sum()
        time.sleep(0.003)  # let the forward's trailing work finish
        before = _cpu_snapshot()
        if mode is not None:
            backward(cid, [loss])
        time.sleep(0.003)  # and the backward's (answers, callbacks)
        after = _cpu_snapshot()
    return [b - a for a, b in zip(before, after, strict=True)]


def noop_leaf() -> int:
    return 0


@torch.distributed.rpc.functions.async_execution
def noop_hop() -> torch.futures.Future:
    return torch.distributed.rpc.rpc_async("worker2", noop_leaf)


_HOPS_DONE = threading.Event()


def one_way_hop(route: list, grad: torch.Tensor) -> None:
    """A gradient message with no graph work: send it on along ``route``, or end the walk."""
    if route:
        torch.distributed.rpc.rpc_async(route[0], one_way_hop, args=(route[1:], grad))
    else:
        _HOPS_DONE.set()


def _four_hops(grad: torch.Tensor) -> float:
    _HOPS_DONE.clear()
    t0 = time.perf_counter()
    torch.distributed.rpc.rpc_async(
        "worker1", one_way_hop, args=(["worker2", "worker1", "worker0"], grad)
    )
    _HOPS_DONE.wait()
    return time.perf_counter() - t0


def _ignore(answer, error) -> None:
    pass


def channel_hop(route: list, grad: torch.Tensor) -> None:
    """``one_way_hop`` over refimpl's gradient channel instead of an RPC."""
    if route:
        _channel().call(int(route[0][-1]), channel_hop, (route[1:], grad), _ignore)
    else:
        _HOPS_DONE.set()


def _channel():
    import importlib

    return importlib.import_module("refimpl.distributed_autograd.context").container().channel


def _four_channel_hops(grad: torch.Tensor) -> float:
    _HOPS_DONE.clear()
    t0 = time.perf_counter()
    _channel().call(1, channel_hop, (["worker2", "worker1", "worker0"], grad), _ignore)
    _HOPS_DONE.wait()
    return time.perf_counter() - t0


def _local_compute(x: torch.Tensor) -> float:
    h = x
    for _ in range(4):
        h = lat._layer(h)
    loss = h.sum()
    t0 = time.perf_counter()
    torch.autograd.backward([loss])
    return time.perf_counter() - t0


def _driver(repeats: int) -> None:
    from torch.distributed import rpc

    for r in range(3):
        rpc.rpc_sync(f"worker{r}", lat._setup, args=(256, r))
    x = torch.randn(32, 256, requires_grad=True)
    for _ in range(20):
        lat._chain_once("refimpl", x)
        lat._chain_once("torch", x)
    for r in range(3):
        rpc.rpc_sync(f"worker{r}", lat._setup_small, args=(100, 64, r))
    xs = [torch.randn(64, requires_grad=True) for _ in range(100)]
    cpu: dict = {"refimpl": [], "torch": [], None: []}
    cpu_small: dict = {"refimpl": [], "torch": [], None: []}
    for _ in range(repeats):  # before the stage timers go in: they cost CPU too
        for mode in cpu:
            cpu[mode].append(_cpu_of_backward(mode, x))
            cpu_small[mode].append(_cpu_of_backward(mode, xs))
    for r in range(3):
        rpc.rpc_sync(f"worker{r}", instrument)
        rpc.rpc_sync(f"worker{r}", reset)
    whole, torch_whole, floor, hops, compute, chops = [], [], [], [], [], []
    grad = torch.randn(32, 256)
    for _ in range(repeats):
        whole.append(lat._chain_once("refimpl", x))
        torch_whole.append(lat._chain_once("torch", x))
        t0 = time.perf_counter()
        rpc.rpc_sync("worker1", noop_hop)
        rpc.rpc_sync("worker1", noop_hop)
        floor.append(time.perf_counter() - t0)
        hops.append(_four_hops(grad))
        chops.append(_four_channel_hops(grad))
        compute.append(_local_compute(x))
    stages: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for r in range(3):
        for stage, (total, calls) in rpc.rpc_sync(f"worker{r}", collect).items():
            stages[stage][0] += total
            stages[stage][1] += calls
    ms = 1e3
    print(
        f"refimpl backward median   {statistics.median(whole) * ms:8.3f} ms  (mean {statistics.mean(whole) * ms:.3f})"
    )
    print(f"torch backward median     {statistics.median(torch_whole) * ms:8.3f} ms")
    print(f"rpc no-op x2 hops median  {statistics.median(floor) * ms:8.3f} ms")
    hop_ms, compute_ms = statistics.median(hops) * ms, statistics.median(compute) * ms
    torch_ms = statistics.median(torch_whole) * ms
    print(f"4 one-way hops median     {hop_ms:8.3f} ms")
    print(f"local compute median      {compute_ms:8.3f} ms")
    chan_ms = statistics.median(chops) * ms
    print(
        f"4 hops on the channel     {chan_ms:8.3f} ms  (refimpl's gradient channel, same messages)"
    )
    print(
        f"python-rpc floor          {hop_ms + compute_ms:8.3f} ms  "
        f"= {(hop_ms + compute_ms) / torch_ms:.2f}x torch's backward; "
        f"refimpl {statistics.median(whole) * ms / torch_ms:.2f}x"
    )
    print(
        f"channel floor             {chan_ms + compute_ms:8.3f} ms  "
        f"= {(chan_ms + compute_ms) / torch_ms:.2f}x torch's backward"
    )
    for label, samples in (("", cpu), ("100-tensors ", cpu_small)):
        base = [statistics.mean(c[w] for c in samples[None]) for w in range(3)]
        per = {
            mode: [statistics.mean(c[w] for c in samples[mode]) - base[w] for w in range(3)]
            for mode in ("refimpl", "torch")
        }
        for mode, workers in per.items():
            print(
                f"{label + mode + ' cpu / backward':<26}{sum(workers) * ms:8.3f} ms  "
                "(workers 0, 1, 2: " + ", ".join(f"{w * ms:.3f}" for w in workers) + ")"
            )
        ratio = sum(per["refimpl"]) / sum(per["torch"])
        print(f"{label + 'cpu ratio refimpl / torch':<26}{ratio:8.2f}x")
    print(f"{'stage (all workers)':<22}{'ms / backward':>14}{'calls / backward':>18}")
    for stage, (total, calls) in sorted(stages.items(), key=lambda kv: -kv[1][0]):
        print(f"{stage:<22}{total / repeats * ms:>14.3f}{calls / repeats:>18.1f}")


def _worker(rank, store_path, repeats):
    from torch.distributed import rpc

    lat.init_worker(rank, 3, store_path)
    try:
        if rank == 0:
            _driver(repeats)
    finally:
        rpc.shutdown()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="dist-autograd-profile-")  # 0700: private
    try:
        mp.spawn(_worker, args=(os.path.join(tmp, "rendezvous"), args.repeats), nprocs=3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
