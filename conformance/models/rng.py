"""The random-number streams a forward may draw from, captured and restored per rank.

Dropout (and any other `torch.rand*` in forward) draws from torch's default generator. A rank
process starts its stream at `torch.manual_seed(seed_of(scenario))` and every forward advances
it; the rank records the state it had before each forward (`capture`), and the oracle replays
that rank's forward from the same state (`restore`), so each rank's masks are reproduced
exactly. The oracle also knows where each rank's stream *should* be (where the rank's previous
forward left it): a recorded state that differs means the engine drew random numbers between
forwards (at construction, in a hook, in a collective), which changes every dropout mask from
what one process would draw (`describe_break`).

Streams the oracle cannot replay per rank (Python's `random`, NumPy's global generator) are
found by `probe` before any process starts.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

try:  # NumPy is optional: torch does not need it
    import numpy as _np
except ImportError:  # pragma: no cover - numpy ships with torch's wheels here
    _np = None


def seed_of(seed: int, rank: int) -> int:
    """The seed a rank gives torch's default generator before it builds and trains."""
    return seed


def capture(device: str | torch.device = "cpu") -> dict:
    """torch's default generator state (CPU, and the device's on CUDA), for the record."""
    state = {"cpu": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(torch.device(device))
    return state


class ForwardTap:
    """The RNG state at the moment the user's module starts its forward (a forward pre-hook, put on
    before the engine wraps it): what that forward's masks are drawn from, after whatever the
    engine's own wrapper did first. `take()` returns the first such state since the last take."""

    def __init__(self, module, device="cpu"):
        self.device, self._first = device, None
        self._handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if self._first is None:
            self._first = capture(self.device)

    def take(self, fallback: dict | None = None) -> dict | None:
        first, self._first = self._first, None
        return first if first is not None else fallback

    def remove(self) -> None:
        self._handle.remove()


def restore(state: dict, device: str | torch.device = "cpu") -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], torch.device(device))


def start(seed: int, rank: int, device: str | torch.device = "cpu") -> dict:
    """The state a rank's stream starts from (what the rank loop seeds), without touching the caller's."""
    with torch.random.fork_rng(devices=[torch.device(device)] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(seed_of(seed, rank))
        return capture(device)


def same(a: dict | None, b: dict | None) -> bool:
    if a is None or b is None:
        return True  # nothing recorded: nothing to compare
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def describe_break(rank: int, step: int, micro: int) -> str:
    """The one-line cause for a stream that was moved between forwards."""
    where = "its construction" if (step, micro) == (0, 0) else "the rank's previous forward"
    return (f"rank {rank}'s random-number stream before the forward of step {step}, micro-batch {micro} is not where "
            f"{where} left it: the engine drew random numbers between forwards, so every dropout mask differs "
            "from what one process draws")


def probe(forward: Callable[[], object]) -> list[str]:
    """Which generators `forward()` draws from: "torch" (replayable), "python", "numpy" (not)."""
    py, np_state = random.getstate(), (_np.random.get_state() if _np is not None else None)
    with torch.random.fork_rng(devices=[]):
        before = torch.get_rng_state()
        forward()
        used = [] if torch.equal(before, torch.get_rng_state()) else ["torch"]
    if random.getstate() != py:
        used.append("python")
        random.setstate(py)
    if _np is not None and not _same_numpy(np_state, _np.random.get_state()):
        used.append("numpy")
        _np.random.set_state(np_state)
    return used


def _same_numpy(a, b) -> bool:
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and a[2:] == b[2:]
