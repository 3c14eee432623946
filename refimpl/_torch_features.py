"""Which of the torch features refimpl relies on this torch has, found by feature detection.

refimpl is tested with one torch minor release (``TESTED_TORCH``; pyproject.toml declares the
same range and CI installs that version). A user can still end up on another torch (a GPU
image's own, a conda environment, ``pip install --no-deps``). A name that torch renamed or
has not added yet must then give a one-line message that says what to do, never an
``AttributeError`` from deep inside an import. So each feature is looked up here, once:

- found: the torch object itself is used (no wrapper, no cost);
- missing, but emulated from other torch APIs: the emulation is used, silently;
- missing and not emulated: a :class:`Missing` placeholder takes its place. It raises a
  one-line ``RuntimeError`` when the part that needs it is used, and the feature is listed
  in the one-line :class:`TorchFeatureWarning` issued when ``refimpl._torch_compat`` is
  imported. The rest of refimpl keeps working.

Each resolver takes the torch module (tests pass one with the attribute deleted, which is how
every fallback here is proven on the torch CI runs: tests/refimpl/test_torch_features.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

__all__ = [
    "TESTED_TORCH",
    "Missing",
    "TorchFeatureWarning",
    "missing_message",
    "resolve_accelerator_available",
    "resolve_autograd_tls",
    "resolve_engine_run_backward",
    "resolve_profiler_enabled",
    "resolve_queue_callback",
    "resolve_register_hook",
    "warn_missing",
]

# The one torch minor release refimpl is tested with; pyproject.toml says torch>=2.13,<2.14
# (tests/refimpl/test_torch_features.py checks both agree, and with constraints.txt).
TESTED_TORCH = "2.13"
INSTALL_HINT = "pip install 'torch>=2.13,<2.14'"


class TorchFeatureWarning(UserWarning):
    """A torch feature refimpl uses is missing on this torch (one line; see the module doc)."""


class Missing:
    """Stands for a torch feature this torch lacks: calling it raises a one-line error."""

    def __init__(self, feature: str, used_for: str) -> None:
        self.feature, self.used_for = feature, used_for

    def __call__(self, *args, **kwargs):
        import torch

        raise RuntimeError(
            f"{self.used_for} needs {self.feature}, which torch {torch.__version__} lacks; "
            f"refimpl is tested with torch {TESTED_TORCH}: {INSTALL_HINT}")

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Missing({self.feature!r})"


def _lookup(root, dotted: str):
    """``root.a.b.c`` or None when any part is missing."""
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


# -- autograd thread-local state -----------------------------------------------------------------
_TLS_USE = "distributed autograd's gradient capture"


def resolve_autograd_tls(torch) -> tuple[Callable, Callable, Callable, Callable]:
    """``(has, get, stash, remove)`` for objects kept in the thread-local state autograd carries
    to the threads that run a backward.

    ``_remove_obj_from_tls`` is the newest of the four: without it, removal stores a tombstone
    and ``has`` treats a tombstone as absent (the same answers, one more call per lookup).
    """
    c = torch._C
    has, get = getattr(c, "_is_key_in_tls", None), getattr(c, "_get_obj_in_tls", None)
    stash, remove = getattr(c, "_stash_obj_in_tls", None), getattr(c, "_remove_obj_from_tls", None)
    if has is None or get is None or stash is None:
        lacking = [f"torch._C.{name}" for name, f in
                   (("_is_key_in_tls", has), ("_get_obj_in_tls", get), ("_stash_obj_in_tls", stash)) if f is None]
        missing = Missing(" and ".join(lacking), _TLS_USE)
        return missing, missing, missing, missing
    if remove is not None:
        return has, get, stash, remove
    tombstone = _Tombstone()

    def has_emulated(key: str) -> bool:
        return has(key) and get(key) is not tombstone

    def remove_emulated(key: str) -> None:
        stash(key, tombstone)

    return has_emulated, get, stash, remove_emulated


class _Tombstone:
    """What an emulated removal leaves in the autograd TLS (``has`` reads it as absent)."""

    __slots__ = ()


# -- the autograd engine ----------------------------------------------------------------------
def resolve_engine_run_backward(torch) -> Callable:
    """The engine entry point ``torch.autograd.backward`` ends in.

    Older torch has no ``torch.autograd.graph._engine_run_backward``; it calls the execution
    engine's ``run_backward`` with the same arguments, which is what this falls back to.
    """
    found = _lookup(torch, "autograd.graph._engine_run_backward")
    if found is not None:
        return found
    engine = _lookup(torch, "autograd.Variable._execution_engine")
    if engine is None or not hasattr(engine, "run_backward"):
        return Missing("torch.autograd.graph._engine_run_backward", "distributed autograd's backward")

    def engine_run_backward(tensors, grad_tensors, keep_graph, create_graph, inputs, *,
                            allow_unreachable=True, accumulate_grad=True):
        return engine.run_backward(tensors, grad_tensors, keep_graph, create_graph, inputs,
                                   allow_unreachable=allow_unreachable, accumulate_grad=accumulate_grad)

    return engine_run_backward


def resolve_queue_callback(torch) -> Callable:
    """The execution engine's ``queue_callback`` (no emulation: nothing else tells from Python
    when a graph task has finished)."""
    engine = _lookup(torch, "autograd.Variable._execution_engine")
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        return Missing("torch.autograd.Variable._execution_engine.queue_callback",
                       "the DDP reducer and the sharded engines (end-of-backward callback)")
    return queue


def resolve_profiler_enabled(torch) -> Callable[[], bool]:
    """Whether the autograd profiler records; without the private query, "always": profiler
    scopes are then opened on every backward (correct, only slower)."""
    found = _lookup(torch, "autograd._profiler_enabled")
    return found if found is not None else _always


def _always() -> bool:
    return True


def resolve_register_hook(torch):
    """``torch.autograd.Function._register_hook`` (the helper every node hook registration goes
    through), or None: the node-hook watch then reports hooks as always seen (the safe answer)."""
    return _lookup(torch, "autograd.Function._register_hook")


def resolve_accelerator_available(torch) -> Callable[[], bool]:
    """``torch.accelerator.is_available`` (torch >= 2.6); before it, CUDA is the accelerator
    torch's pinned-memory check asks for."""
    found = _lookup(torch, "accelerator.is_available")
    return found if found is not None else torch.cuda.is_available


# -- the message -------------------------------------------------------------------------------
def missing_message(version: str, missing: list[Missing]) -> str:
    """One line: which features this torch lacks, what stops working, what to do."""
    parts = "; ".join(f"{m.feature} ({m.used_for})" for m in missing)
    return (f"refimpl: torch {version} lacks {parts}: those parts raise when used, the rest works; "
            f"refimpl is tested with torch {TESTED_TORCH} ({INSTALL_HINT})")


def warn_missing(version: str, features: list) -> str | None:
    """Issue the one-line :class:`TorchFeatureWarning` when any of ``features`` is Missing."""
    missing = list({m.feature: m for m in features if isinstance(m, Missing)}.values())
    if not missing:
        return None
    message = missing_message(version, missing)
    # warn_explicit with no source line: the warning prints as exactly one line.
    warnings.warn_explicit(message, TorchFeatureWarning, filename="refimpl", lineno=0)
    return message
