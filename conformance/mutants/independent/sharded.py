"""Independent known-bad sharded engines (issue 30), from `docs/contracts/sharded.md` and `DESIGN.md`.

`Engine` is refimpl's `ShardedDataParallel` with its reduction split into seams (who has a
gradient, what a rank without one sends, the divisor, how a result lands in the shard); each
mutant changes one seam, or one method of the engine or its optimizer, the way a person
writing it could. Adapters drive them exactly as `refimpl-sharded` is driven
(`conformance.adapters.sharded.RefimplShardedWrapped`, the engine's own optimizer).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters.sharded import RefimplShardedWrapped, refimpl_sharded_kwargs
from conformance.mutants.firing import Fires
from conformance.mutants.registry import Registry
from conformance.spec import Capability
from refimpl import _torch_compat as compat
from refimpl.ddp.unused_params import reaches_any
from refimpl.sharded import ShardedDataParallel
from refimpl.sharded.engine import ReduceState
from refimpl.sharded.optimizer import ShardedOptimizer

MUTANTS = Registry("indep-sharded")


class Engine(Fires, ShardedDataParallel):
    """refimpl's engine, its end-of-backward reduction written out with seams."""

    def used_counts(self) -> list[int]:
        """How many ranks hold a gradient, per slot (the same list on every rank)."""
        used = torch.tensor([s.param.grad is not None for s in self._slots], dtype=torch.int32,
                            device=self._slots[0].param.device)
        dist.all_reduce(used, group=self.process_group)
        return used.tolist()

    def zeros_for(self, slot) -> torch.Tensor:
        """What a rank without a gradient reduce-scatters: zeros of the parameter's dtype."""
        return slot.param.new_zeros(slot.chunk * self.world_size)

    def divisor(self, n_ranks: int) -> int:
        return self.world_size

    @torch.no_grad()
    def _reduce_gradients(self) -> None:
        W = self.world_size
        for slot, n_ranks in zip(self._slots, self.used_counts(), strict=True):
            if n_ranks == 0:
                continue
            grad = slot.param.grad
            padded = self.zeros_for(slot)
            if grad is not None:
                padded = slot.param.new_zeros(slot.chunk * W)
                torch.div(grad.reshape(-1), self.divisor(n_ranks), out=padded[:slot.numel])
            self.bucketer.reduce_scatter_async(list(padded.view(W, slot.chunk)), self.process_group,
                                               functools.partial(self._accumulate, slot))
        self.bucketer.flush()
        self.bucketer.teardown()
        for slot in self._slots:
            slot.param.grad = None
        self._state = ReduceState.IDLE


class Wrapped(RefimplShardedWrapped):
    """`refimpl-sharded`'s driver plus the engine's fired count (the zoo reads `backward_stats()`)."""

    def backward_stats(self) -> dict:
        return {"mutation_fired": self.sdp.mutation_fired}


class Correct:
    name = "indep-sharded-correct"
    area = "sharded"
    version = "0"
    capabilities = frozenset({Capability.NO_SYNC, Capability.FIND_UNUSED, Capability.BUCKET_CAP,
                              Capability.BUFFER_BROADCAST, Capability.HALF_PRECISION})
    owns = frozenset({"optimizer"})
    engine_class = Engine
    bug, clause, may_abort, dimension = "", "", False, ""

    def wrap(self, module: nn.Module, ctx, options, optimizer=None):
        sdp = self.engine_class(module, process_group=ctx.group, **refimpl_sharded_kwargs(options))
        opt = None
        if optimizer is not None and optimizer.name != "none":
            opt = sdp.make_optimizer(optimizer.build)
        return Wrapped(sdp, opt)


def mutant(name: str, clause: str, dimension: str, bug: str, **kw):
    """Register an Engine subclass as mutant `name`, wrapped in an adapter class."""
    def adapter(engine_cls):
        return type(f"{engine_cls.__name__}Adapter", (Correct,), {"engine_class": engine_cls, "dimension": dimension})
    return MUTANTS.mutant(name, clause, f"[{dimension}] {bug}", adapter=adapter, **kw)


@mutant("overwrites-sharded-grad", "S14", "how often",
        "the reduced chunk is copied into the sharded gradient, not added: a second synced backward without "
        "zero_grad() replaces the first one's gradient")
class OverwritesShardedGrad(Engine):
    def _accumulate(self, slot, reduced):
        self._fired(slot.shard.grad is not None)
        view = slot.flat.grads[slot.offset:slot.offset + slot.chunk]
        view.copy_(reduced)
        slot.shard.grad = view


@mutant("sync-read-at-backward", "S5", "when",
        "whether to reduce is read from no_sync() at backward time, not captured at forward: a forward inside "
        "no_sync() whose backward runs outside it is reduced (and the reverse is not)", may_abort=True)
class SyncReadAtBackward(Engine):
    def _on_grad_accumulated(self, param):
        self._fired(self._sync != self._sync_backward and self._state is ReduceState.IDLE)
        if self._sync and self._state is ReduceState.IDLE:
            self._state = ReduceState.REDUCE_QUEUED
            compat.queue_backward_callback(self._reduce_gradients)


@mutant("rank0-decides-used", "S6", "who",
        "which parameters to reduce is broadcast from rank 0 instead of agreed by all ranks: a parameter only a "
        "non-zero rank used is never reduced")
class Rank0DecidesUsed(Engine):
    def used_counts(self):
        used = torch.tensor([s.param.grad is not None for s in self._slots], dtype=torch.int32,
                            device=self._slots[0].param.device)
        agreed = used.clone()
        dist.all_reduce(agreed, group=self.process_group)
        dist.broadcast(used, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        self._fired(bool(((agreed > 0) != (used > 0)).any()))
        return (used * self.world_size).tolist()


@mutant("divides-by-used-ranks", "S6", "who",
        "a gradient is divided by the number of ranks that used the parameter, not by the world size")
class DividesByUsedRanks(Engine):
    def divisor(self, n_ranks):
        self._fired(n_ranks != self.world_size)
        return n_ranks


@mutant("unused-zeros-default-dtype", "S10", "ambient", may_abort=True,
        bug="a rank without a gradient sends torch.zeros(n) (the default dtype): for non-float32 parameters the "
            "ranks' reduce-scatters land in buckets of different dtypes")
class UnusedZerosDefaultDtype(Engine):
    def zeros_for(self, slot):
        self._fired(slot.param.dtype != torch.get_default_dtype() and slot.param.grad is None)
        return torch.zeros(slot.chunk * self.world_size, device=slot.param.device)


@mutant("no-buffer-init-broadcast", "S1", "who",
        "construction broadcasts rank 0's parameters but not its buffers: with broadcast_buffers=False every rank "
        "keeps its own buffers")
class NoBufferInitBroadcast(Engine):
    def __init__(self, module, *args, **kwargs):
        own = [b.detach().clone() for b in module.buffers()]
        super().__init__(module, *args, **kwargs)
        with torch.no_grad():
            for b, mine in zip(module.buffers(), own, strict=True):
                self._fired(not torch.equal(b, mine))
                b.copy_(mine)


@mutant("drops-forward-kwargs", "S2", "inputs",
        "forward(*args, **kwargs) calls the module with the positional arguments only")
class DropsForwardKwargs(Engine):
    def forward(self, *args, **kwargs):
        self._fired(bool(kwargs))
        return super().forward(*args)


@mutant("buffers-broadcast-once", "S7", "how often",
        "rank 0's buffers are broadcast before the first forward only (a flag set once), not before every forward")
class BuffersBroadcastOnce(Engine):
    def forward(self, *args, **kwargs):
        if getattr(self, "_buffers_synced", False):
            self._fired(self.broadcast_buffers and self.world_size > 1 and any(True for _ in self.module.buffers()))
            self.broadcast_buffers, keep = False, self.broadcast_buffers
            try:
                return super().forward(*args, **kwargs)
            finally:
                self.broadcast_buffers = keep
        self._buffers_synced = True
        return super().forward(*args, **kwargs)


@mutant("idle-check-ignores-no-sync", "S8", "when", may_abort=True,
        bug="a rank whose forward reaches no parameter reduces at once even inside no_sync(): it enters collectives "
            "the other ranks do not")
class IdleCheckIgnoresNoSync(Engine):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if not self._sync_backward and torch.is_grad_enabled() and not reaches_any(out, self._param_ids):
            self._fired()
            self._state = ReduceState.REDUCE_QUEUED
            self._reduce_gradients()
        return out


class _ZeroGradKeepsLocal(ShardedOptimizer):
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model._fired(any(p.grad is not None for p in self.model.module.parameters()))
        self.optimizer.zero_grad(set_to_none=set_to_none)  # the local no_sync() gradients stay


@mutant("zero-grad-keeps-local", "S5", "when",
        "the optimizer's zero_grad() clears the sharded gradients but not the local no_sync() accumulation: a "
        "micro-batch accumulated before zero_grad() is reduced with the next synced backward")
class ZeroGradKeepsLocal(Engine):
    def make_optimizer(self, optimizer_class, **kwargs):
        return _ZeroGradKeepsLocal(self, optimizer_class, **kwargs)


class _GathersBeforeStep(ShardedOptimizer):
    def step(self, closure=None):
        self.model._fired()
        self.model.gather_parameters()
        return self.optimizer.step(closure)


@mutant("gathers-before-step", "S4", "when",
        "the optimizer all-gathers the parameters before stepping its shard: every rank's full parameters lag one step")
class GathersBeforeStep(Engine):
    def make_optimizer(self, optimizer_class, **kwargs):
        return _GathersBeforeStep(self, optimizer_class, **kwargs)


def correct() -> Correct:
    return Correct()


globals().update(MUTANTS.factories())
