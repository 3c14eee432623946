"""The user's own model, inputs and loss (`gradparity run --model pkg.mod:build --batch
pkg.mod:batch [--loss pkg.mod:loss]`, `conformance.check_model`).

- `build()` returns the user's `nn.Module`, initialised the user's way. It is called under a
  rank-dependent torch seed, so an init that draws random numbers gives every rank different
  weights and the construction-time sync is tested; the oracle builds rank 0's the same way.
- `batch(rank, step, micro)` returns that rank's inputs for one micro-batch, or a 2-tuple
  `(inputs, target)`. `inputs` is a tensor (`model(x)`), a tuple/list (`model(*inputs)`) or a
  dict (`model(**inputs)`). No `rank=`/`micro=` keyword reaches the user's forward.
- `loss(output, target)` (or `loss(output)` when `batch` gives no target) returns a scalar;
  without one the suite's loss is used: a fixed weighted sum of every output element.

A scenario carries the three references as plain text in its `model` field
(`UserModel.encode`), so it pickles to the rank processes, which import them the same way;
`path` is put first on a rank's `sys.path` so a module found next to a test file or in the
working directory imports there too. The case id shows only the build reference (`UserModel.name`).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

PREFIX = "user:"


class UserModelError(ValueError):
    """A reference that does not resolve, or a build/batch/loss that breaks its contract: one line."""


@dataclass(frozen=True)
class UserModel:
    build: str  # "pkg.mod:attr"
    batch: str
    loss: str = ""
    path: str = ""  # a directory put first on sys.path before importing (where the module lives)

    @property
    def name(self) -> str:
        """What case ids show: the build reference."""
        return self.build

    def encode(self) -> str:
        return PREFIX + "|".join((self.build, self.batch, self.loss, self.path))

    @staticmethod
    def decode(text: str) -> UserModel:
        return _decode(text)


def is_user(model: str) -> bool:
    return model.startswith(PREFIX)


@functools.lru_cache(maxsize=32)
def _decode(text: str) -> UserModel:
    build, batch, loss, path = text.removeprefix(PREFIX).split("|", 3)
    return UserModel(build, batch, loss, path)


def resolve(ref: str, what: str, path: str = "") -> Callable:
    """Import `pkg.mod:attr` (attr may be dotted); a one-line error says what to fix."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise UserModelError(f"--{what} {ref!r}: expected pkg.module:function")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: a module in the working directory imports
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserModelError(f"--{what} {ref!r}: cannot import {module_name!r} ({exc}); check the module path") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserModelError(f"--{what} {ref!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserModelError(f"--{what} {ref!r}: {attr!r} is not callable")
    return obj


def ref_of(obj: Callable | str, what: str) -> tuple[str, str]:
    """(reference, directory) for a callable handed to `check_model` (rank processes import it)."""
    if isinstance(obj, str):
        return obj, ""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if module is None or "<" in qualname or module == "__main__":
        raise UserModelError(f"{what}: {obj!r} is not importable by the rank processes; pass a module-level "
                             "function of an importable module (or its 'pkg.module:function' path)")
    file = getattr(sys.modules.get(module), "__file__", None)
    depth = module.count(".") + 1
    path = os.path.dirname(os.path.abspath(file)) if file else ""
    for _ in range(depth - 1):
        path = os.path.dirname(path)
    return f"{module}:{qualname}", path


def build(user: UserModel, *, seed: int, rank: int) -> nn.Module:
    """The user's module, built under a rank-dependent seed (their own initialisation)."""
    factory = resolve(user.build, "model", user.path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 7919 + rank)
        model = factory()
    if not isinstance(model, nn.Module):
        raise UserModelError(f"--model {user.build!r} returned {type(model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise UserModelError(f"--model {user.build!r}: the module has no trainable parameter")
    return model


@dataclass
class UserBatch:
    """One rank's micro-batch as the user's `batch()` gave it: inputs and an optional target."""

    inputs: object
    target: object = None
    has_target: bool = False

    def head(self, size: int) -> UserBatch:
        """The first `size` samples (uneven shards): every tensor cut along dim 0."""
        cut = lambda t: t[:size] if isinstance(t, torch.Tensor) and t.dim() else t  # noqa: E731
        return UserBatch(_map(self.inputs, cut), _map(self.target, cut), self.has_target)

    def to(self, device) -> UserBatch:
        move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return UserBatch(_map(self.inputs, move), _map(self.target, move), self.has_target)


def _map(obj, fn):
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return fn(obj)


def batch(user: UserModel, *, rank: int, step: int, micro: int, device="cpu", size: int = 0) -> UserBatch:
    """Rank `rank`'s micro-batch; `size` > 0 keeps its first `size` samples (uneven shards)."""
    got = resolve(user.batch, "batch", user.path)(rank, step, micro)
    if isinstance(got, tuple) and len(got) == 2:
        out = UserBatch(got[0], got[1], True)
    else:
        out = UserBatch(got)
    if not _tensors(out.inputs):
        raise UserModelError(f"--batch {user.batch!r} returned no tensor for rank {rank}, step {step}, micro {micro}")
    return (out.head(size) if size > 0 else out).to(device)


def _tensors(obj) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map(obj, lambda t: found.append(t) if isinstance(t, torch.Tensor) else None)
    return found


def call(model, b: UserBatch):
    """The user's forward on the user's inputs, exactly as the user calls it."""
    if isinstance(b.inputs, dict):
        return model(**b.inputs)
    if isinstance(b.inputs, (list, tuple)):
        return model(*b.inputs)
    return model(b.inputs)


def loss(user: UserModel, output, b: UserBatch, default: Callable) -> torch.Tensor:
    if not user.loss:
        return default(output)
    fn = resolve(user.loss, "loss", user.path)
    value = fn(output, b.target) if b.has_target else fn(output)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise UserModelError(f"--loss {user.loss!r} must return a scalar tensor, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Inspection:
    """What one forward/backward of the user's model in this process showed, before any rank starts."""

    batch_size: int  # dim 0 of the first input tensor
    unused: tuple[str, ...]  # parameters without a gradient after one backward: find_unused_parameters
    randomness: tuple[str, ...]  # generators the forward draws from: "torch" (replayed), "python", "numpy"
    parameters: int
    has_buffers: bool = False  # floating-point buffers (BatchNorm statistics ...): a buffer rule applies


def inspect(user: UserModel, default_loss: Callable, *, seed: int = 0) -> Inspection:
    """Build, draw rank 0's first batch, forward, loss (`default_loss` without the user's), backward:
    every contract checked, each broken one said in one line."""
    from conformance.models.rng import probe

    model = build(user, seed=seed, rank=0)
    b = batch(user, rank=0, step=0, micro=0)
    holder = {}

    def forward():
        holder["out"] = call(model, b)

    try:
        used = probe(forward)
    except Exception as exc:  # the user's forward on the user's batch: say where it broke, in one line
        raise UserModelError(f"--model {user.build!r} forward on --batch {user.batch!r} raised "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    value = loss(user, holder["out"], b, default_loss)
    if not value.requires_grad:
        raise UserModelError(f"the loss of --model {user.build!r} does not depend on any parameter")
    value.backward()
    unused = tuple(n for n, p in model.named_parameters() if p.requires_grad and p.grad is None)
    first = _tensors(b.inputs)[0]
    return Inspection(int(first.shape[0]) if first.dim() else 1, unused, tuple(used),
                      sum(1 for p in model.parameters() if p.requires_grad),
                      any(b.is_floating_point() for b in model.buffers()))
