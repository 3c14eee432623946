"""parallel_apply: run replica `i` on input `i`, one thread per replica.

Why threads: the replicas' forwards are independent and mostly run in C++ kernels that
release the GIL, so threads overlap them (on several GPUs, or on several CPU cores when
each replica's kernels are small). With a single replica no thread is started.

[Note: thread-local state]
Grad mode, inference mode and autocast are thread-local in torch; a new thread starts with
the defaults. They are captured in the calling thread and re-entered in each worker, so
`with torch.no_grad(): data_parallel(...)` and `with torch.autocast(...)` mean the same
as without data_parallel. For CUDA replicas the worker also makes the replica's device and
the caller's current stream on it current (`devices.device_context`, `capture_stream`).

[Note: errors]
Every replica runs to completion; then the *first* exception raised (in time) is re-raised
as `ReplicaError`, whose message names the replica index and device and whose `__cause__`
is the original exception (with its traceback). Catch `ReplicaError` and inspect
`err.__cause__` / `err.replica_index` / `err.device`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .devices import DeviceLike, capture_stream, device_context, normalize_device, stream_context
from .scatter_gather import _tensors

__all__ = ["ReplicaError", "parallel_apply"]


class ReplicaError(RuntimeError):
    """An exception raised in one replica's forward; the original is `__cause__`."""

    def __init__(self, replica_index: int, device: torch.device | None, original: BaseException):
        self.replica_index = replica_index
        self.device = device
        where = f"replica {replica_index}" + (f" on device {device}" if device is not None else "")
        super().__init__(f"{where} raised {type(original).__name__}: {original}")


def _autocast_states(device_types: set[str]) -> dict[str, tuple[bool, torch.dtype]]:
    return {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in device_types}


def _infer_device(inp: Any) -> torch.device | None:
    for _, t in _tensors(inp):
        return t.device
    return None


def parallel_apply(
    modules: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs: Sequence[Mapping[str, Any]] | None = None,
    devices: Sequence[DeviceLike | None] | None = None,
) -> list[Any]:
    """Return `[modules[i](*inputs[i], **kwargs[i]) for i ...]`, computed in parallel.

    `inputs[i]` that is a tuple is the positional arguments; anything else (a tensor, a
    list, a dict) is the single argument. `devices[i]` (default: the device of the first
    tensor in `inputs[i]`) is made current while replica `i` runs.
    """
    n = len(modules)
    if len(inputs) != n:
        raise ValueError(f"parallel_apply: got {n} modules but {len(inputs)} inputs; need one input per module")
    if kwargs is None:
        kwargs = [{}] * n
    elif len(kwargs) != n:
        raise ValueError(f"parallel_apply: got {n} modules but {len(kwargs)} kwargs; need one dict per module")
    if devices is None:
        devs = [_infer_device(inp) for inp in inputs]
    elif len(devices) != n:
        raise ValueError(f"parallel_apply: got {n} modules but {len(devices)} devices; need one device per module")
    else:
        devs = [None if d is None else normalize_device(d) for d in devices]
    if n == 0:
        return []

    grad_enabled = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    autocast = _autocast_states({d.type for d in devs if d is not None} | {"cpu"})
    streams = [capture_stream(d) for d in devs]

    results: list[Any] = [None] * n
    errors: list[tuple[int, BaseException]] = []  # in the order they happened
    lock = threading.Lock()

    def work(i: int) -> None:
        dev = devs[i]
        dtype_enabled = autocast[dev.type if dev is not None else "cpu"]
        try:
            with (
                torch.inference_mode(inference),
                torch.set_grad_enabled(grad_enabled),
                device_context(dev),
                stream_context(streams[i]),
                torch.autocast(
                    device_type=dev.type if dev is not None else "cpu",
                    dtype=dtype_enabled[1],
                    enabled=dtype_enabled[0],
                ),
            ):
                args = inputs[i] if isinstance(inputs[i], tuple) else (inputs[i],)
                results[i] = modules[i](*args, **kwargs[i])
        except Exception as exc:  # re-raised in the caller (Note: errors)
            with lock:
                errors.append((i, exc))

    if n == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(i,), name=f"parallel_apply-{i}") for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        i, exc = errors[0]
        raise ReplicaError(i, devs[i], exc) from exc
    return results
