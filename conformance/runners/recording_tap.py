"""Taps: tensors an in-process area judges as it runs, offered to the case's recording.

`data_parallel` compares in the coordinator as it goes, so no rank record carries its values;
its runner calls `tap(...)` at each point it judges, which is a no-op unless the case pipeline
is recording this case (`tapping(True)` around the run, `conformance.recording`). Here, below
the runners, so a runner depends on nothing above it (tests/test_import_layers.py).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_TAPPED: contextvars.ContextVar[list | None] = contextvars.ContextVar("gradparity_tapped", default=None)


def tap(point: str, step: int | None, kind: str, tensors: dict, *, micro: int | None = None) -> None:
    """Offer tensors to the recording of the case running in this context (a no-op unless one is).

    For areas that compare in the coordinator as they go, so no rank record carries the values."""
    sink = _TAPPED.get()
    if sink is not None:
        sink.append({"point": point, "step": step, "micro": micro, "kind": kind,
                     "values": {n: (t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t)
                                for n, t in tensors.items()}})


@contextlib.contextmanager
def tapping(enabled: bool):
    """Collect `tap`s made inside (a list; None when not `enabled`)."""
    if not enabled:
        yield None
        return
    sink: list = []
    token = _TAPPED.set(sink)
    try:
        yield sink
    finally:
        _TAPPED.reset(token)
