"""Interaction bugs in sharded engines (issue 38), written from the contracts and user docs alone.

The sharded counterpart of `interactions_ddp.py`: each mutant is refimpl's ZeRO-3
`FullyShardedDataParallel` (or its ZeRO-2 `ShardedDataParallel`), correct everywhere except
where two things meet — clipping on an HSDP mesh, a mixed-precision policy with HSDP or with a
placement function, a checkpoint round trip under a policy or with shards W does not divide,
16-bit parameters with large gradients. Modelled on real reports: pytorch/pytorch#170862 (clip x
sharding), #155903 (divide factor x 2-D mesh), #176076 (uneven shards), DeepSpeed PR #7985
(bf16 x fp32 master state). Written from `docs/contracts/sharded.md`, `docs/sharded.md` and
refimpl's public API without reading the scenario catalogue.

`mutation_fired` (read through `backward_stats()`) counts only where the bug changed a value
the correct engine would have produced; where that needs the correct collective, the mutant
runs it too and compares. Run::

    gradparity zoo --area sharded --set interactions --profile standard
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from conformance.adapters.sharded import (
    RefimplSharded,
    RefimplShardedWrapped,
    RefimplZero3,
    RefimplZero3Wrapped,
    refimpl_sharded_kwargs,
    refimpl_zero3_kwargs,
    sharded_optimizer,
)
from conformance.mutants.firing import Fires
from conformance.mutants.registry import Registry
from refimpl.sharded import FullyShardedDataParallel, ShardedDataParallel
from refimpl.sharded.bucketer import _reduce_scatter_single
from refimpl.sharded.engine import ReduceState

MUTANTS = Registry("ix-sharded")
MODULE = __name__


class _Counting(Fires):
    """The engines here count with the one helper (`conformance.mutants.firing`)."""


class Zero3(_Counting, FullyShardedDataParallel):
    """refimpl's ZeRO-3 plus a fired count."""

    def load_checkpoint(self, kind: str, state: dict, optimizer) -> None:
        from conformance.adapters import sharded_state

        sharded_state.refimpl_load(self, kind, state, optimizer)

    def checkpoint(self, kind: str, optimizer) -> dict:
        from conformance.adapters import sharded_state

        return sharded_state.refimpl_state(self, kind, optimizer)


class Zero2(_Counting, ShardedDataParallel):
    """refimpl's ZeRO-2 plus a fired count."""


class _Zero3Wrapped(RefimplZero3Wrapped):
    def backward_stats(self) -> dict:
        return {"mutation_fired": self.sdp.mutation_fired}

    def checkpoint(self, kind: str, optimizer) -> dict:
        return self.sdp.checkpoint(kind, optimizer)  # the engine's own checkpoint API (its bugs too)

    def load_checkpoint(self, kind: str, state: dict, optimizer) -> None:
        self.sdp.load_checkpoint(kind, state, optimizer)


class _Zero2Wrapped(RefimplShardedWrapped):
    def backward_stats(self) -> dict:
        return {"mutation_fired": self.sdp.mutation_fired}


class Correct(RefimplZero3):
    """`refimpl-zero3` around `engine_class`: the control the ZeRO-3 mutants are judged against."""

    engine_class = Zero3
    name = "ix-sharded-correct"
    bug, clause, may_abort, pair, base = "", "", False, "", ""

    def wrap(self, module, ctx, options, optimizer=None):
        engine = self.engine_class(module, **refimpl_zero3_kwargs(module, options, ctx))
        return _Zero3Wrapped(engine, sharded_optimizer(engine, optimizer), options.accumulate_reduce_scattered)


class CorrectZero2(RefimplSharded):
    """`refimpl-sharded` (ZeRO-2) around `engine_class`: the control of the ZeRO-2 mutants."""

    engine_class = Zero2
    name = "ix-sharded-correct-zero2"
    bug, clause, may_abort, pair, base = "", "", False, "", ""

    def wrap(self, module, ctx, options, optimizer=None):
        engine = self.engine_class(module, process_group=ctx.group, **refimpl_sharded_kwargs(options))
        return _Zero2Wrapped(engine, sharded_optimizer(engine, optimizer))


def mutant(name: str, clause: str, pair: str, bug: str, *, zero2: bool = False, **kw):
    """Register an engine subclass as mutant `name`, inside the matching correct adapter."""
    def adapter(engine_cls):
        parent, base = (CorrectZero2, f"{MODULE}:correct_zero2") if zero2 else (Correct, f"{MODULE}:correct")
        return type(f"{engine_cls.__name__}Adapter", (parent,),
                    {"engine_class": engine_cls, "base": base})
    return MUTANTS.interaction(name, clause, pair, bug, adapter=adapter, **kw)


def _coef(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    return (max_norm / (total + 1e-6)).clamp(max=1.0)


class _ClipsWrong(Zero3):
    """A clipping mutant: computes the right and the wrong total norm, clips by the wrong one."""

    def _shard_grads(self) -> list[torch.Tensor]:
        return [q.shard.grad for q in self._params if q.shard is not None and q.shard.grad is not None]

    def _clip_by(self, grads, right: torch.Tensor, wrong: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Scale `grads` by `wrong`'s coefficient; fired where it differs from `right`'s."""
        coef = _coef(wrong, max_norm)
        self._fired(not torch.equal(coef, _coef(right, max_norm)))
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return wrong


# -- clipping -------------------------------------------------------------------------------------
@mutant("hsdp-clip-counts-replicas", "S22", "clip_grad_norm_ x HSDP mesh",
        "the squared norm is summed over the shard group and again over the replicas, which hold the "
        "same chunks: the norm is sqrt(R) too large and the gradients are clipped too hard")
class HsdpClipCountsReplicas(_ClipsWrong):
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if self._replicas.group is None or norm_type != 2.0:
            return super().clip_grad_norm_(max_norm, norm_type)
        grads = self._shard_grads()
        sq = sum((g.float().abs().pow(2.0).sum() for g in grads), torch.zeros(()))
        dist.all_reduce(sq, group=self.process_group)
        right = sq.pow(0.5)  # refimpl.sharded.clip's arithmetic, so the two agree but for the bug
        dist.all_reduce(sq, group=self._replicas.group)  # the bug: replicas counted as more data
        wrong = sq.pow(0.5)
        return self._clip_by(grads, right, wrong, max_norm)


@mutant("clip-norm-in-param-dtype", "S22", "clip_grad_norm_ x mixed-precision policy",
        "with param_dtype=bf16 the norm's squares are summed in bf16 (the compute dtype), not in fp32: "
        "the clip coefficient is off by up to 2**-8 relative whenever clipping is active")
class ClipNormInParamDtype(_ClipsWrong):
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        low = self.mp.param_dtype
        if low is None or norm_type != 2.0:
            return super().clip_grad_norm_(max_norm, norm_type)
        grads = self._shard_grads()
        right_sq = sum((g.float().abs().pow(2.0).sum() for g in grads), torch.zeros(()))
        wrong_sq = sum((g.to(low).abs().pow(2.0).sum() for g in grads), torch.zeros((), dtype=low)).float()
        both = torch.stack([right_sq, wrong_sq])
        dist.all_reduce(both, group=self.process_group)
        right, wrong = both.pow(0.5)
        return self._clip_by(grads, right, wrong, max_norm)


# -- mixed precision meets a mesh or a placement ----------------------------------------------------
@mutant("hsdp-mp-divides-by-shard-group", "S19", "mixed-precision policy x HSDP mesh",
        "the reduce-dtype path divides each share by the shard group's size S, not by S*R: on a "
        "(replicate, shard) mesh the gradient comes out R times too large (pytorch#155903's class)")
class HsdpMpDividesByShardGroup(Zero3):
    def _chunks_to_reduce(self, q, device):
        if self.mp.param_dtype is None or self.dp_size == self.world_size:
            return super()._chunks_to_reduce(q, device)
        held = q.acc if q.acc is not None else q.param.grad
        saved, self.dp_size = self.dp_size, self.world_size
        try:
            chunks = super()._chunks_to_reduce(q, device)
        finally:
            self.dp_size = saved
        self._fired(held is not None and bool(held.ne(0).any()))
        return chunks


@mutant("placement-dim1-cast-path", "S18", "shard_placement_fn (dim 1) x mixed-precision policy",
        "when the gradient is cast to reduce_dtype, the placement layout is skipped: a parameter sharded "
        "on dim 1 gets its gradient scattered in row-major order, so each element lands on another's slot")
class PlacementDim1CastPath(Zero3):
    def _chunks_to_reduce(self, q, device):
        if self.mp.param_dtype is None or q.dim == 0:
            return super()._chunks_to_reduce(q, device)
        held = q.acc if q.acc is not None else q.param.grad
        right = None
        if held is not None:  # the correct chunks, from a copy (the engine divides the gradient in place)
            acc, q.acc = q.acc, held.clone()
            try:
                right = super()._chunks_to_reduce(q, device)
            finally:
                q.acc = acc
        dim, q.dim = q.dim, 0
        try:
            chunks = super()._chunks_to_reduce(q, device)
        finally:
            q.dim = dim
        self._fired(right is not None and any(not torch.equal(a, b) for a, b in zip(right, chunks, strict=True)))
        return chunks


# -- checkpoints --------------------------------------------------------------------------------------
@mutant("checkpoint-load-through-compute-dtype", "S16", "state-dict round trip x mixed-precision policy",
        "under a bf16 policy the load writes the parameters through the compute copy (rounded to bf16) "
        "before resharding: the fp32 masters lose their low bits at every resume (DeepSpeed PR #7985's class)")
class CheckpointLoadThroughComputeDtype(Zero3):
    def load_checkpoint(self, kind: str, state: dict, optimizer) -> None:
        low = self.mp.param_dtype
        if low is not None:
            for value in state["model"].values():
                local = value.to_local() if hasattr(value, "to_local") else value
                if local.is_floating_point() and local.dtype != low:
                    rounded = local.to(low).to(local.dtype)
                    self._fired(int((rounded != local).sum()))
                    local.copy_(rounded)
        super().load_checkpoint(kind, state, optimizer)


@mutant("full-load-uneven-offset", "S16", "full state-dict load x parameters W does not divide",
        "loading a full state dict, a rank's chunk starts at rank*(numel//W) instead of rank*ceil(numel/W): "
        "where W does not divide numel every rank but 0 takes shifted values (pytorch#176076's class)")
class FullLoadUnevenOffset(Zero3):
    def load_checkpoint(self, kind: str, state: dict, optimizer) -> None:
        from refimpl.sharded import checkpoint

        right = checkpoint._mine

        def wrong(value, chunk, rank):
            out = right(value, chunk, rank)
            n = value.numel()
            if hasattr(value, "to_local") or n % self.world_size == 0:
                return out
            start = rank * (n // self.world_size)
            bad = chunk.new_zeros(chunk.numel())
            part = value.reshape(-1)[start:start + chunk.numel()]
            bad[:part.numel()] = part
            self._fired(not torch.equal(bad, out))
            return bad

        checkpoint._mine = wrong  # this rank's process, for this call only
        try:
            super().load_checkpoint(kind, state, optimizer)
        finally:
            checkpoint._mine = right


# -- ZeRO-2: 16-bit parameters and large values --------------------------------------------------------
@mutant("zero2-half-sum-then-divide", "S10", "ZeRO-2 x fp16 parameters x large gradients",
        "for 16-bit parameters the shares are reduce-scattered undivided and the chunk divided after "
        "(for precision): the fp16 sum overflows to inf where dividing each share first stays finite",
        zero2=True)
class Zero2HalfSumThenDivide(Zero2):
    @torch.no_grad()
    def _reduce_gradients(self) -> None:
        assert self._state is ReduceState.REDUCE_QUEUED, f"internal: reduce in {self._state}"
        used = torch.tensor([s.param.grad is not None for s in self._slots], dtype=torch.int32,
                            device=self._slots[0].param.device)
        dist.all_reduce(used, group=self.process_group)
        W = self.world_size
        for slot, n_ranks in zip(self._slots, used.tolist(), strict=True):
            if n_ranks == 0:
                continue
            grad = slot.param.grad
            half = slot.param.dtype in (torch.float16, torch.bfloat16)
            padded = slot.param.new_zeros(slot.chunk * W)
            if grad is not None:
                padded[:slot.numel] = grad.reshape(-1) if half else grad.reshape(-1) / W
            callback = functools.partial(self._accumulate, slot)
            if half:
                right = slot.param.new_empty(slot.chunk)
                _reduce_scatter_single(right, padded / W, group=self.process_group)  # the correct chunk
                callback = functools.partial(self._divide_then_accumulate, slot, right)
            self.bucketer.reduce_scatter_async(list(padded.view(W, slot.chunk)), self.process_group, callback)
        self.bucketer.flush()
        self.bucketer.teardown()
        for slot in self._slots:
            slot.param.grad = None
        self._state = ReduceState.IDLE

    def _divide_then_accumulate(self, slot, right, reduced) -> None:
        wrong = reduced / self.world_size
        self._fired(int((wrong.view(torch.int16) != right.view(torch.int16)).sum()))
        self._accumulate(slot, wrong)


def correct() -> Correct:
    return Correct()


def correct_zero2() -> CorrectZero2:
    return CorrectZero2()


globals().update(MUTANTS.factories())
