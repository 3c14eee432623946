"""Where a world's ranks run and how they talk: a `Topology`, chosen once per pool.

Plain data and one decision (`choose_topology`), below the harness: the area registry says
where its scenarios run and the pipeline keys its pools by it, without importing the harness
that starts the processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Topology:
    """Where ranks run and how they talk: chosen once per pool."""

    world_size: int
    backend: str  # "gloo" | "nccl"
    device: str  # "cpu" | "cuda"
    shared_gpu: bool = False  # ranks share cuda:0 (gloo with CUDA tensors)

    def rank_device(self, rank: int) -> str:
        """The device of the rank ``rank`` *of its node* (under torchrun, ``LOCAL_RANK``: global
        rank 4 of 2 nodes x 4 GPUs is GPU 0 of the second node)."""
        if self.device == "cpu":
            return "cpu"
        return "cuda:0" if self.shared_gpu else f"cuda:{rank}"

    def key(self) -> str:
        gpu = "/shared-gpu" if self.shared_gpu else ""
        return f"w{self.world_size}/{self.backend}/{self.device}{gpu}"


def choose_topology(world_size: int, device: str, backend: str = "auto") -> Topology:
    """gloo on CPU; NCCL when every rank has its own GPU; gloo with CUDA tensors otherwise."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if device == "cpu":
        if backend not in ("auto", "gloo"):
            raise ValueError(f"backend {backend!r} cannot run CPU tensors; use gloo")
        return Topology(world_size, "gloo", "cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch.cuda.is_available() is False")
    own_gpus = torch.cuda.device_count() >= world_size
    if backend == "auto":
        backend = "nccl" if own_gpus else "gloo"
    if backend == "nccl" and not own_gpus:
        raise ValueError(f"NCCL needs one GPU per rank: world size {world_size}, {torch.cuda.device_count()} GPUs")
    return Topology(world_size, backend, "cuda", shared_gpu=not own_gpus)
