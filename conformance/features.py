"""Production-training features of a DDP scenario, shared by the rank loop and the oracle.

A scenario's `features` (plain data, see `Scenario.features`) turn on what real training
adds around the wrapper. Both sides read them through `Features`, and build inputs,
autocast contexts and requires_grad schedules with the functions here, so the oracle
replays exactly what the ranks did:

- ``join``: per-rank batch counts (uneven shards; a rank may get 0), run under the
  wrapper's ``join(divide_by_initial_world_size=..., throw_on_early_termination=...)``.
  The oracle averages each step over the active ranks' gradients with the documented
  divisor: the initial world size (torch's default) or the number of active ranks.
- ``autocast``: forward under ``torch.autocast(device, dtype)``; ``grad_scaler``: the loss
  scaled by ``torch.amp.GradScaler(init_scale)`` and ``scaler.step``/``update`` instead of
  ``optimizer.step``; ``inf_at``: (rank, step) whose input gets an ``inf``, so the scaler
  must skip that step on every rank (the all-reduce spreads the overflow).
- ``checkpoint``: the model (``ckpt-mlp``) checkpoints its segments
  (``torch.utils.checkpoint``, ``non-reentrant`` or ``reentrant``); the oracle runs it
  without checkpointing (same kernels, same gradients).
- ``compile``: ``torch.compile`` around the ``model`` (before wrapping) or the ``wrapper``,
  with the ``compile_backend`` (``aot_eager``: Dynamo + AOT autograd, no C++ toolchain); or
  ``compiled-autograd``: each backward under ``torch._dynamo.compiled_autograd`` with that backend
  (torch DDP built in its ``optimize_ddp="python_reducer"`` mode, the one it reduces in there).
- ``clip``: ``clip_grad_norm_(max_norm)`` on the averaged gradients before each step.
- ``freeze``: ``((step, name_prefix, requires_grad), ...)``: requires_grad toggled before
  that step's forward (bucket rebuild, unused parameters).
- ``save_load_at``: after that many steps (or at each of several steps), save the wrapper's
  ``state_dict`` (torch DDP's ``module.``-prefixed keys) and the optimizer's, rebuild model,
  wrapper and optimizer from the checkpoint, and train on: the oracle trains straight through. ``state_dict`` ("full" or
  "sharded"): the sharded area's round trip instead (`conformance.runners.sharded_checkpoint`).
  ``resume_order``: where the rebuilt loop loads the checkpoint (before or after wrapping; the
  optimizer's state before the first backward or after it), `conformance.runners.build_order`.
- ``wrap_under``: ``"no_grad"``: the wrapper is constructed inside ``torch.no_grad()`` (ambient
  state at construction, e.g. a model wrapped in an evaluation setup): neither the construction
  sync nor the gradient hooks may depend on it.
- ``repeat``: run the whole scenario twice and report whether every gradient was bitwise
  identical (the determinism check; a failure only for an adapter that declares
  ``deterministic = True``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields

import torch

from conformance.models.data import DTYPES, make_inputs, make_optimizer
from conformance.spec import Scenario


@dataclass(frozen=True)
class Features:
    join: tuple[int, ...] = ()
    divide_by_initial_world_size: bool = True
    throw_on_early_termination: bool = False
    autocast: str = ""
    grad_scaler: bool = False
    init_scale: float = 2.0**10
    inf_at: tuple[int, int] | None = None
    checkpoint: str = ""  # "non-reentrant" | "reentrant" (models with a `checkpoint` argument)
    compile: str = ""  # "model" | "wrapper" | "compiled-autograd" (the backward under torch._dynamo's compiled autograd)
    compile_backend: str = "aot_eager"
    clip: float | None = None
    freeze: tuple[tuple[int, str, bool], ...] = ()
    save_load_at: int | tuple[int, ...] | None = None
    # sharded area (issue #26): the round trip saves "full" or "sharded" (torch.distributed.checkpoint)
    # state dicts through the engine's own API (conformance.runners.sharded_checkpoint)
    state_dict: str = ""
    # where a round trip loads the checkpoint (issue 38, conformance.runners.build_order): "" or
    # "wrap-load" (after wrapping), "load-wrap" (into the bare module), "optimizer-late"
    resume_order: str = ""
    wrap_under: str = ""  # "no_grad" (issue 30: ambient state at construction)
    repeat: int = 1
    # A small dyadic learning rate: 5+ steps on small-integer data stay finite (the base
    # catalogue's 2**-4 diverges to inf/nan by step 4 here, which would hide wrong values).
    lr: float = 2.0**-10

    @classmethod
    def of(cls, scenario: Scenario) -> Features:
        known = {f.name for f in fields(cls)}
        given = dict(scenario.features)
        unknown = set(given) - known
        if unknown:
            raise ValueError(f"scenario {scenario.id}: unknown features {sorted(unknown)}; known: {sorted(known)}")
        return cls(**given)

    def steps(self, scenario: Scenario, rank: int) -> int:
        """How many steps (batches) `rank` trains on."""
        return self.join[rank] if self.join else scenario.steps

    def total_steps(self, scenario: Scenario) -> int:
        if not self.join:
            return scenario.steps
        return min(self.join) if self.throw_on_early_termination else max(self.join)

    def active(self, step: int) -> list[int]:
        """The ranks that still have a batch at `step` (join)."""
        return [r for r, n in enumerate(self.join) if step < n]

    def divisor(self, world_size: int, step: int) -> int:
        if self.join and not self.divide_by_initial_world_size:
            return len(self.active(step))
        return world_size

    @property
    def round_trips(self) -> tuple[int, ...]:
        """The steps before which the checkpoint round trip runs (`save_load_at`)."""
        at = self.save_load_at
        return () if at is None else (at,) if isinstance(at, int) else tuple(at)

    def requires_grad_at(self, step: int) -> list[tuple[str, bool]]:
        return [(prefix, flag) for s, prefix, flag in self.freeze if s == step]

    def describe(self) -> str:
        defaults = Features()
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                         if getattr(self, f.name) != getattr(defaults, f.name))


def inputs(scenario: Scenario, feats: Features, *, rank: int, step: int, micro: int, device):
    """Rank `rank`'s shard, with the scenario's injected overflow where it asks for one."""
    (x,) = make_inputs(
        scenario.model, seed=scenario.seed, rank=rank, step=step, micro=micro,
        size=scenario.shard_size(rank), dtype=scenario.dtype, device=device,
    )
    if (feats.inf_at is not None and tuple(feats.inf_at) == (rank, step) and isinstance(x, torch.Tensor)
            and x.is_floating_point()):
        x = x.clone()
        x.view(-1)[0] = float("inf")
    return x


def autocast(feats: Features, device) -> contextlib.AbstractContextManager:
    if not feats.autocast:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=DTYPES[feats.autocast])


def wrapping(feats: Features, device) -> contextlib.AbstractContextManager:
    """The ambient state the wrapper is constructed in (`wrap_under`)."""
    if feats.wrap_under == "no_grad":
        return torch.no_grad()
    if feats.wrap_under:
        raise ValueError(f"wrap_under: {feats.wrap_under!r} is not 'no_grad'")
    return contextlib.nullcontext()


def apply_requires_grad(module: torch.nn.Module, feats: Features, step: int) -> None:
    """Toggle requires_grad as the schedule says, before `step`'s forward."""
    for prefix, flag in feats.requires_grad_at(step):
        hits = [p for n, p in module.named_parameters() if n.startswith(prefix)]
        if not hits:
            raise ValueError(f"freeze schedule: no parameter named {prefix}*")
        for p in hits:
            p.requires_grad_(flag)


def optimizer(scenario: Scenario, feats: Features, params):
    """The scenario's optimizer at the features' learning rate (ranks and oracle alike)."""
    opt = make_optimizer(scenario.optimizer, params)
    if opt is not None:
        for group in opt.param_groups:
            group["lr"] = feats.lr
    return opt


def model_kwargs(scenario: Scenario, feats: Features, *, oracle: bool) -> dict:
    """The model's arguments: ranks checkpoint as asked, the oracle runs without (same math)."""
    kwargs = scenario.kwargs()
    if feats.checkpoint:
        kwargs["checkpoint"] = "none" if oracle else feats.checkpoint
    return kwargs
