"""A debug check that every tensor a collective sees is on the rank's device.

NCCL takes only tensors on the rank's GPU; a tensor built without ``device=`` lands on the
CPU and NCCL refuses it ("No backend type associated with device type cpu"), deep inside the
engine; gloo takes it, so a CPU-only CI never sees the bug (the CPU stand-in below does). Inside
``expect_collective_device(device)`` every ``torch.distributed`` collective checks the device
of each tensor it is given and raises :class:`CollectiveDeviceError`, naming the collective,
the tensor and the line that called it, before anything is sent: a tensor of a device type its
group's backend does not take (a CPU tensor on NCCL), or on another GPU than the rank's. A CPU
tensor on a gloo group passes (gloo takes CPU and CUDA tensors: an engine's own CPU side group
is no bug).

Usage::

    with expect_collective_device(torch.device("cuda", local_rank)):
        train_one_step()            # any collective on a CPU tensor raises here

[Note: the CPU stand-in] On a machine without a GPU every tensor is on the CPU, so nothing
could be caught. ``stray="meta"`` makes torch's factory functions called *without* a device
(``torch.tensor``, ``torch.zeros``, ... : ``STRAY_FACTORIES``) build on the meta device
instead, in every thread (autograd hooks included), just as on a GPU they build on the CPU
instead of the rank's GPU, while the rank's real tensors stay on the CPU, the expected
device::

    with expect_collective_device("cpu", stray="meta"):
        model.all_reduce_gradients()  # torch.tensor([...]) without device= now raises

(``torch.set_default_device`` would not do: it does not reach autograd hooks or other threads.)

How it hooks in: the collectives are looked up by name on ``torch.distributed`` at every call
(``dist.all_reduce(...)``), so wrapping those module attributes sees every call refimpl and the
suite's rank-side code make; torch's own internals call their module's functions directly and
are not checked (tests/refimpl/test_device_check.py keeps refimpl's code calling by name).
The check is process-wide while any ``expect_collective_device`` is active and costs one
Python call per collective; outside it torch's functions are restored untouched.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["COLLECTIVES", "STRAY_FACTORIES", "CollectiveDeviceError", "expect_collective_device"]

# The torch.distributed functions that move tensor data (barrier builds its own tensor; object
# collectives pick their own device from the backend).
COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "all_to_all",
    "all_to_all_single", "batch_isend_irecv", "broadcast", "gather", "irecv", "isend", "recv",
    "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "scatter", "send",
)


# torch's factory functions that build on the default device unless given one.
STRAY_FACTORIES = ("arange", "empty", "eye", "full", "linspace", "ones", "rand", "randint", "randn", "tensor",
                   "zeros")


class CollectiveDeviceError(RuntimeError):
    """A collective was given a tensor on a device other than the rank's."""


_lock = threading.Lock()
_expected: list[torch.device] = []  # innermost last; shared by every thread (collectives are)
_originals: dict[str, object] = {}
_HERE = Path(__file__).resolve()
_TORCH = Path(torch.__file__).resolve().parent


def _tensors(value, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a collective's argument: itself, in a list, or a P2POp's."""
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{where}[{i}]")
    elif isinstance(value, dist.P2POp):
        yield f"{where}.tensor", value.tensor


def _caller() -> str:
    """The first frame outside torch and this module: the line that called the collective."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = Path(frame.filename).resolve()
        if path != _HERE and _TORCH not in path.parents:
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def _group_device_types(group) -> frozenset[str] | None:
    """The device types the group's backend takes ("cpu:gloo,cuda:nccl" -> cpu and cuda; gloo
    takes both; nccl CUDA only); None when unknown (a custom backend, or no group yet)."""
    try:
        backend = str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):
        return None
    if ":" in backend:
        return frozenset(part.split(":", 1)[0] for part in backend.split(","))
    return {"gloo": frozenset({"cpu", "cuda"}), "nccl": frozenset({"cuda"})}.get(backend)


def _misplaced(t: torch.Tensor, expected: torch.device, takes: frozenset[str] | None) -> str:
    """Why ``t`` must not reach the collective ('' when it may).

    A tensor of a device type the group's backend does not take is refused (NCCL and a CPU
    tensor); one of the rank's device type must be on the rank's device itself (another GPU).
    A CPU tensor on a gloo group is legitimate (gloo takes both): no false alarm there.
    """
    if takes is not None and t.device.type not in takes:
        return f"its group's backend takes no {t.device.type} tensor"
    if (takes is None or t.device.type == expected.type) and t.device != expected:
        return "another device than the rank's"
    return ""


def _check(name: str, signature: inspect.Signature | None, args: tuple, kwargs: dict) -> None:
    expected = _expected[-1] if _expected else None
    if expected is None:
        return
    try:
        named = list(signature.bind_partial(*args, **kwargs).arguments.items())  # type: ignore[union-attr]
    except (AttributeError, TypeError):  # no signature, or a call torch itself will refuse
        named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    takes = _group_device_types(dict(named).get("group"))
    for label, value in named:
        for where, t in _tensors(value, label):
            why = _misplaced(t, expected, takes)
            if why:
                raise CollectiveDeviceError(
                    f"dist.{name} got a tensor on {t.device} ({where}, {tuple(t.shape)} {t.dtype}; {why}) but this "
                    f"rank's collectives run on {expected}: build it with device= the rank's device "
                    f"(called from {_caller()})")


def _wrap(name: str, fn):
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        _check(name, signature, args, kwargs)
        return fn(*args, **kwargs)

    checked.__wrapped_collective__ = fn
    return checked


def _install() -> None:
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None:
            _originals[name] = fn
            setattr(dist, name, _wrap(name, fn))


def _uninstall() -> None:
    for name, fn in _originals.items():
        setattr(dist, name, fn)
    _originals.clear()


@contextlib.contextmanager
def _stray_factories(device: torch.device) -> Iterator[None]:
    """torch's factories build on ``device`` when called without one ([Note: the CPU stand-in])."""
    originals = {name: getattr(torch, name) for name in STRAY_FACTORIES}

    def build_on(fn):
        @functools.wraps(fn)
        def factory(*args, **kwargs):
            if kwargs.get("device") is None:
                kwargs["device"] = device
            return fn(*args, **kwargs)

        return factory

    for name, fn in originals.items():
        setattr(torch, name, build_on(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)


@contextlib.contextmanager
def expect_collective_device(device: torch.device | str, *, stray: torch.device | str | None = None):
    """Within: every collective's tensors must be on ``device`` (see the module docstring).

    ``stray``: the device that torch's factories called without ``device=`` build on, process
    wide (the CPU stand-in for tests, [Note: the CPU stand-in]); None leaves them alone.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        raise ValueError("expect_collective_device needs the rank's device with its index, e.g. cuda:0")
    with _lock:
        if not _expected:
            _install()
        _expected.append(device)
    try:
        with _stray_factories(torch.device(stray)) if stray is not None else contextlib.nullcontext():
            yield device
    finally:
        with _lock:
            _expected.remove(device)
            if not _expected:
                _uninstall()
