"""The checks ci/gpu-smoke.sh runs, one per call: ``python ci/gpu_smoke.py STEP [--device D]``.

Each step prints one line saying what it saw and exits 0 (passed), 1 (failed) or 3 (no GPU on
this machine). ``--device cpu`` runs the same code on the CPU, which is how the CPU tests prove
the steps themselves (tests/test_gpu_smoke.py).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = 3


def step_torch(device: str) -> int:
    import torch

    pinned = re.search(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    version = torch.__version__.split("+")[0]
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    if version != pinned:
        print(f"torch {torch.__version__} ({build} build) is not the pinned torch {pinned} (constraints.txt)")
        return 1
    print(f"torch {torch.__version__} ({build} build), the pinned version")
    return 0


def step_refimpl(device: str) -> int:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        import refimpl._torch_compat  # noqa: F401 - its import is the check
        from refimpl._torch_features import TorchFeatureWarning
    missing = [str(w.message) for w in seen if issubclass(w.category, TorchFeatureWarning)]
    if missing:
        print(missing[0])
        return 1
    print("refimpl imports; every torch feature it uses is present")
    return 0


def step_gpu(device: str) -> int:
    import torch

    if device == "cpu":
        print("GPU check skipped (--device cpu)")
        return 0
    if not torch.cuda.is_available():
        why = "a CPU build of torch" if not torch.version.cuda else "CUDA build, but no usable GPU or driver"
        print(f"NO GPU: torch.cuda.is_available() is False (torch {torch.__version__}: {why}); "
              f"nothing GPU-specific can be checked on this machine")
        return NO_GPU
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"{len(names)} GPU(s): {', '.join(names)}; CUDA {torch.version.cuda}; "
          f"NCCL {'available' if torch.distributed.is_nccl_available() else 'NOT available'}")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_rank(rank: int, world: int, port: int, device_type: str, out) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from refimpl import DistributedDataParallel as DDP
    from refimpl.device_check import expect_collective_device

    if device_type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, device_id=device if backend == "nccl" else None)
    try:
        torch.manual_seed(rank)  # rank-dependent: DDP must broadcast rank 0's parameters
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
        with expect_collective_device(device):
            ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=0.0001)
            x = torch.full((3, 4), float(rank + 1), device=device)
            ddp(x).sum().backward()
        grads = [p.grad.detach().cpu() for p in model.parameters()]
        everyone = [None] * world
        dist.all_gather_object(everyone, grads)
        same = all(torch.equal(a, b) for g in everyone for a, b in zip(g, everyone[0], strict=True))
        out.put((rank, backend, str(device), same))
    finally:
        dist.destroy_process_group()


def step_ddp(device: str) -> int:
    """Two ranks train one step through refimpl's DDP with every collective checked to be on the
    rank's device (NCCL with two GPUs, gloo with CUDA tensors on one)."""
    import torch
    import torch.multiprocessing as mp

    if device == "cuda" and not torch.cuda.is_available():
        print("NO GPU")
        return NO_GPU
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port, world = _free_port(), 2
    procs = [ctx.Process(target=_ddp_rank, args=(r, world, port, device, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        for p in procs:
            if p.is_alive():
                p.kill()
        print(f"a rank failed (exit codes {codes}); its traceback is above")
        return 1
    results = sorted(out.get(timeout=10) for _ in range(world))
    if not all(same for *_, same in results):
        print(f"gradients differ across ranks: {results}")
        return 1
    _, backend, _, _ = results[0]
    print(f"2 ranks, {backend}, devices {[d for _, _, d, _ in results]}: one DDP step, every collective on "
          f"the rank's device, gradients identical across ranks")
    return 0


STEPS = {"torch": step_torch, "refimpl": step_refimpl, "gpu": step_gpu, "ddp": step_ddp}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return STEPS[args.step](args.device)


if __name__ == "__main__":
    sys.exit(main())
