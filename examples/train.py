"""Train a small model with refimpl's DistributedDataParallel under torchrun.

    torchrun --nproc-per-node 2 examples/train.py [--steps 5]

CPU ranks use gloo; when CUDA is available each rank takes one GPU and uses NCCL. The
loop is the usual DDP loop: only the import differs from torch's.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from refimpl import DistributedDataParallel as DDP


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    ddp = DDP(model, device_ids=[local_rank] if use_cuda else None, process_group=dist.group.WORLD)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    # Each rank draws its own shard of a fixed regression problem.
    gen = torch.Generator().manual_seed(1 + rank)
    w_true = torch.arange(16, dtype=torch.float32) / 16
    for step in range(args.steps):
        x = torch.randn(args.batch, 16, generator=gen)
        y = (x @ w_true).unsqueeze(1)
        loss = nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0:
            print(f"step {step} loss {avg.item() / world:.4f}", flush=True)

    # Parameters stay identical on every rank.
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks diverged"
    if rank == 0:
        stats = ddp.get_backward_stats()
        print(f"done: {len(ddp.bucket_plan)} bucket(s), comm overlapped with backward: {stats.overlap_fraction():.0%}")
    # Every rank finishes its last collective before any rank tears the group down: without
    # this, gloo can abort at exit ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
