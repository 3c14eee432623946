"""Device lists: normalisation, defaults and the "make this device current" context.

Every entry point of `refimpl.data_parallel` accepts devices the way users write them
(`0`, `"cuda:1"`, `"cpu"`, `torch.device(...)`) and turns them into `torch.device` once,
here, so the rest of the package compares devices with `==` and never guesses.

Why a list of CPU devices is legal: the engine has one code path for CPU and GPU. A list
such as `["cpu", "cpu", "cpu"]` runs three replicas on the CPU, each in its own thread,
which is how the package is tested on machines without a GPU. Repeating a device is
allowed for every device type.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

DeviceLike = int | str | torch.device

__all__ = ["DeviceLike", "normalize_device", "normalize_devices", "default_devices", "device_context",
           "capture_stream", "stream_context"]


def normalize_device(device: DeviceLike) -> torch.device:
    """`0` -> `cuda:0`, `"cuda"` -> `cuda:<current>`, anything else -> `torch.device(device)`.

    A bare integer means a CUDA index, as in `torch.nn.DataParallel(device_ids=[0, 1])`.
    A bare `"cuda"` is pinned to the current CUDA device so that two entries `"cuda"` and
    `"cuda:0"` compare equal when they are the same GPU.
    """
    if isinstance(device, bool):  # bool is an int; reject it before it becomes cuda:1
        raise TypeError(f"a device must be an int, str or torch.device, got {device!r}")
    if isinstance(device, int):
        return torch.device("cuda", device)
    if isinstance(device, (str, torch.device)):
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    raise TypeError(f"a device must be an int, str or torch.device, got {device!r}")


def normalize_devices(devices: Sequence[DeviceLike]) -> list[torch.device]:
    if isinstance(devices, (str, int, torch.device)):
        raise TypeError(
            f"devices must be a list of devices, got the single device {devices!r}; "
            f"write [{devices!r}]"
        )
    out = [normalize_device(d) for d in devices]
    if not out:
        raise ValueError("devices is empty: give at least one device, e.g. ['cpu']")
    return out


def default_devices() -> list[torch.device]:
    """All visible CUDA devices, like torch's DataParallel; a clear error when there are none."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise RuntimeError(
            "data_parallel: no devices were given and no CUDA device is available. "
            "Pass devices explicitly, e.g. devices=['cpu', 'cpu'] to run two replicas on the CPU."
        )
    return [torch.device("cuda", i) for i in range(count)]


def device_context(device: torch.device | None) -> contextlib.AbstractContextManager:
    """Make `device` the current device of this thread (CUDA), a no-op for CPU / None.

    Tensors a module creates with `device="cuda"` (no index) inside its forward then land
    on the replica's GPU, exactly as in `torch.nn.DataParallel`.
    """
    if device is None or device.type == "cpu":
        return contextlib.nullcontext()
    if device.type == "cuda":
        return torch.cuda.device(device)
    module = getattr(torch, device.type, None)  # e.g. torch.xpu; best effort, public API only
    ctx = getattr(module, "device", None)
    if callable(ctx) and device.index is not None:
        return ctx(device.index)
    return contextlib.nullcontext()


def capture_stream(device: torch.device | None):
    """The caller's current stream on `device` (CUDA only; None otherwise).

    CUDA's current stream is thread-local: a fresh thread starts on the default stream. The
    caller captures its stream here and the worker thread re-enters it with
    `stream_context`, so a replica's kernels are ordered after the caller's copies (scatter)
    on that device.
    """
    if device is None or device.type != "cuda":
        return None
    return torch.cuda.current_stream(device)


def stream_context(stream) -> contextlib.AbstractContextManager:
    if stream is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)
