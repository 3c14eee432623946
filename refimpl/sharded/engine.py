"""ShardedDataParallel: data parallel with sharded gradients and optimizer state (ZeRO-2 style).

What each rank holds:
  * the full parameters (forward and backward run on them, as with DDP);
  * for every trainable parameter, one chunk of its flattened gradient and of its optimizer
    state — 1/W of the total, W = process-group size.

One training step:
  1. forward/backward on the full parameters; autograd accumulates the local ``p.grad``;
  2. when the backward finishes, every parameter's gradient is divided by W and
     reduce-scattered through a :class:`~refimpl.sharded.bucketer.ReduceScatterBucketer`: rank r
     receives chunk r of ``(1/W) Σ_ranks grad``; the full local ``p.grad`` is then freed;
  3. the optimizer (any ``torch.optim`` class) steps only this rank's chunks;
  4. the chunks are all-gathered back into the full parameters on every rank.

[Note: shard layout]
Parameter ``p`` with ``n`` elements is flattened and zero-padded to ``c * W`` elements,
``c = ceil(n / W)``; rank r owns elements ``[r*c, (r+1)*c)``. This rank's chunks of all the
parameters of one dtype are laid end to end in one flat buffer (``_FlatShard``): the optimizer
sees one ``nn.Parameter`` per chunk, each a view into that buffer, so all-gathering the
parameters is one collective per dtype. Padding is zero in parameters and gradients, so
element-wise optimizers (SGD, Adam, AdamW, RMSprop, Adagrad …) keep it zero and step every
real element exactly as they would step the full tensor. Optimizers that look across
elements (LAMB, LARS, Adafactor) would see per-chunk norms: not supported; gradient-norm
clipping is ``clip_grad_norm_`` (a global norm: one more all-reduce).

[Note: when gradients are reduced]
All parameters are reduce-scattered in registration order at the end of each synced backward
(``queue_callback`` from the first gradient hook), not as each gradient becomes ready. Why:
ranks may use different parameters (rank-dependent control flow), and bucketing requires the
same sequence of reduce-scatters on every rank (see ``refimpl.sharded.bucketer``). One small
all-reduce of "which parameters have a gradient" first decides, identically everywhere, which
parameters to reduce: a parameter no rank used keeps its sharded gradient unchanged (``None``
after ``zero_grad``), just like a parameter that gets no gradient without data parallelism.
A rank whose synced forward reaches no parameter at all would get no gradient hook, so
``forward`` notices it (an early-exit graph walk) and reduces right away, in the same order
as the others (pytorch/pytorch#40566 is this case for torch's DDP).

Collectives (public names): ``broadcast``, ``all_reduce``, the bucketer's reduce-scatter and
``all_gather_single`` (torch >= 2.10; ``all_gather_into_tensor`` before). End of backward is
detected with ``refimpl._torch_compat.queue_backward_callback`` — torch has no public
"backward finished" hook; FSDP and DDP-style wrappers rely on the same private call.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import _torch_compat as compat
from ..broadcast import broadcast_from_rank0
from ..ddp.unused_params import reaches_any
from .bucketer import ReduceScatterBucketer
from .clip import clip_shards_
from .optimizer import ShardedOptimizer

__all__ = ["ReduceState", "ShardedDataParallel"]

def _all_gather_single(output: Tensor, input: Tensor, *, group) -> None:
    """torch's "one tensor in, one tensor out" all-gather under its current public name
    (``all_gather_single``, torch >= 2.10; ``all_gather_into_tensor`` before), looked up at each
    call so that refimpl.device_check sees it."""
    if hasattr(dist, "all_gather_single"):
        dist.all_gather_single(output, input, group=group)
    else:
        dist.all_gather_into_tensor(output, input, group=group)


class ReduceState(enum.Enum):
    """Where gradient reduction stands.

    IDLE -> (first gradient hook of a synced backward) -> REDUCE_QUEUED
    REDUCE_QUEUED -> (end of that backward: reduce-scatter) -> IDLE
    Reading full gradients or stepping the optimizer is valid only in IDLE.
    """

    IDLE = "idle"
    REDUCE_QUEUED = "reduce-queued"


@dataclass
class _Slot:
    """One trainable parameter and where its chunk lives in this rank's flat shard."""

    name: str
    param: nn.Parameter  # the full parameter inside the module
    numel: int
    chunk: int  # elements per rank (ceil(numel / W)); padding included
    offset: int  # start of this rank's chunk in the flat shard
    flat: _FlatShard
    shard: nn.Parameter | None = None  # this rank's chunk: a view into flat.params


class _FlatShard:
    """This rank's chunks of all parameters of one (dtype, device), end to end."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self.slots: list[_Slot] = []
        self.numel = 0
        self.params = torch.empty(0)
        self.grads = torch.empty(0)

    def allocate(self) -> None:
        self.params = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self.grads = torch.zeros(self.numel, dtype=self.dtype, device=self.device)


def _chunk_of(full: Tensor, slot: _Slot, rank: int, world_size: int) -> Tensor:
    """Rank ``rank``'s chunk of the flattened, zero-padded ``full``."""
    padded = full.new_zeros(slot.chunk * world_size)
    padded[:slot.numel] = full.reshape(-1)
    return padded[rank * slot.chunk:(rank + 1) * slot.chunk]


class ShardedDataParallel(nn.Module):
    """Sharded data parallel (gradients and optimizer state sharded, parameters replicated).

    After each synced backward, the gradient of the full model is ``(1/W) Σ_r ∇L_r``, held
    sharded: read it with :meth:`full_gradients`. The full ``p.grad`` of the wrapped module
    is freed after reduction (that is the memory saving). Step with the optimizer from
    :meth:`make_optimizer`, which all-gathers the updated parameters.

    Usage::

        model = ShardedDataParallel(net, process_group=group)   # broadcasts rank 0's state
        opt = model.make_optimizer(torch.optim.Adam, lr=1e-3)
        for x, y in data:
            loss_fn(model(x), y).backward()   # reduce-scatter runs as backward ends
            opt.step()                        # steps this rank's shard, then all-gathers
            opt.zero_grad()
        with model.no_sync():                 # local accumulation, reduced at next backward
            loss_fn(model(x1), y1).backward()
        loss_fn(model(x2), y2).backward()

    Args:
        module: the model; its parameters and buffers are overwritten by rank 0's.
        process_group: group to shard over (default: the default group, resolved now).
        bucket_cap_mb: reduce-scatter bucket size, see ``ReduceScatterBucketer``.
        broadcast_buffers: broadcast rank 0's buffers before every forward (DDP's rule);
            buffers are always broadcast at construction.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float = 25, broadcast_buffers: bool = True) -> None:
        super().__init__()
        assert dist.is_initialized(), (
            "ShardedDataParallel needs an initialized process group: call "
            "torch.distributed.init_process_group() first")
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = self.process_group.size()
        self.rank = dist.get_rank(self.process_group)
        self.broadcast_buffers = broadcast_buffers
        self.bucketer = ReduceScatterBucketer(bucket_cap_mb)
        self._state = ReduceState.IDLE
        self._sync = True  # False inside no_sync()
        self._sync_backward = True  # captured at forward, like DDP: decides the next backward

        broadcast_from_rank0(list(module.parameters()), self.process_group)
        broadcast_from_rank0(list(module.buffers()), self.process_group)
        self._slots, self._flats = self._build_shards()
        self._hooks = [slot.param.register_post_accumulate_grad_hook(self._on_grad_accumulated)
                       for slot in self._slots]
        self._param_ids = {id(slot.param) for slot in self._slots}

    # --- construction -----------------------------------------------------------------------
    def _build_shards(self) -> tuple[list[_Slot], list[_FlatShard]]:
        flats: dict[tuple[torch.dtype, torch.device], _FlatShard] = {}
        slots = []
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            assert not p.is_sparse, f"parameter {name!r} is sparse: not supported"
            flat = flats.setdefault((p.dtype, p.device), _FlatShard(p.dtype, p.device))
            chunk = math.ceil(p.numel() / self.world_size)
            slot = _Slot(name, p, p.numel(), chunk, flat.numel, flat)
            flat.numel += chunk
            flat.slots.append(slot)
            slots.append(slot)
        with torch.no_grad():
            for flat in flats.values():
                flat.allocate()
                for slot in flat.slots:
                    view = flat.params[slot.offset:slot.offset + slot.chunk]
                    view.copy_(_chunk_of(slot.param.detach(), slot, self.rank, self.world_size))
                    slot.shard = nn.Parameter(view)  # shares storage with flat.params
        return slots, list(flats.values())

    # --- forward / no_sync ------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._state is ReduceState.REDUCE_QUEUED:
            # Only possible if the previous backward raised before its end-of-backward callback.
            warnings.warn("ShardedDataParallel: the previous backward did not finish; its "
                          "gradients stay local and are reduced at the next synced backward",
                          stacklevel=2)
            self._state = ReduceState.IDLE
        if self.broadcast_buffers and self.world_size > 1:
            broadcast_from_rank0(list(self.module.buffers()), self.process_group)
        self._sync_backward = self._sync
        out = self.module(*args, **kwargs)
        if self._sync_backward and torch.is_grad_enabled() and not reaches_any(out, self._param_ids):
            # This rank's backward will fire no gradient hook, yet the other ranks expect its
            # share of every collective (pytorch/pytorch#40566): reduce now, in the same order.
            self._state = ReduceState.REDUCE_QUEUED
            self._reduce_gradients()
        return out

    @property
    def require_backward_grad_sync(self) -> bool:
        """False inside ``no_sync()``: a forward run now is followed by a local-only backward
        (torch DDP's attribute of the same name)."""
        return self._sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in ``p.grad``; the next synced backward reduces them.

        As with DDP, what counts is whether the *forward* ran inside the context: its
        backward then skips the reduction.
        """
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # --- gradient reduction -----------------------------------------------------------------
    def _on_grad_accumulated(self, param: Tensor) -> None:
        if self._sync_backward and self._state is ReduceState.IDLE:
            self._state = ReduceState.REDUCE_QUEUED
            compat.queue_backward_callback(self._reduce_gradients)

    @torch.no_grad()
    def _reduce_gradients(self) -> None:
        assert self._state is ReduceState.REDUCE_QUEUED, f"internal: reduce in {self._state}"
        first = self._slots[0].param
        used = torch.tensor([s.param.grad is not None for s in self._slots], dtype=torch.int32,
                            device=first.device)
        dist.all_reduce(used, group=self.process_group)  # how many ranks have a gradient
        W = self.world_size
        for slot, n_ranks in zip(self._slots, used.tolist(), strict=True):
            if n_ranks == 0:
                continue  # no rank used it: leave its sharded gradient untouched
            grad = slot.param.grad
            # Zeros only where nothing is written: a rank without a gradient, and the padding.
            padded = slot.param.new_zeros(slot.chunk * W) if grad is None else slot.param.new_empty(slot.chunk * W)
            if grad is not None:
                assert not grad.is_sparse, f"sparse gradient for {slot.name!r}: not supported"
                # Divide before summing (as DDP does) so low-precision sums cannot overflow.
                torch.div(grad.reshape(-1), W, out=padded[:slot.numel])
                padded[slot.numel:].zero_()
            self.bucketer.reduce_scatter_async(list(padded.view(W, slot.chunk)),
                                               self.process_group,
                                               functools.partial(self._accumulate, slot))
        self.bucketer.flush()
        self.bucketer.teardown()  # no staging memory between backward passes
        for slot in self._slots:
            slot.param.grad = None
        self._state = ReduceState.IDLE

    @staticmethod
    def _accumulate(slot: _Slot, reduced: Tensor) -> None:
        """Bucketer callback: add the reduced chunk to this rank's sharded gradient."""
        assert slot.shard is not None
        if slot.shard.grad is None:
            view = slot.flat.grads[slot.offset:slot.offset + slot.chunk]
            view.copy_(reduced)
            slot.shard.grad = view
        else:
            slot.shard.grad.add_(reduced)

    # --- sharded optimizer support ----------------------------------------------------------
    def sharded_parameters(self) -> list[nn.Parameter]:
        """This rank's chunks, one ``nn.Parameter`` per trainable parameter (for optimizers)."""
        return [s.shard for s in self._slots if s.shard is not None and s.chunk > 0]

    def make_optimizer(self, optimizer_class: Callable[..., torch.optim.Optimizer],
                       **kwargs) -> ShardedOptimizer:
        """An optimizer over this rank's shard that all-gathers the parameters after step().

        ``optimizer_class(params, **kwargs)`` builds the inner optimizer: a ``torch.optim``
        class, or any factory with that signature.
        """
        return ShardedOptimizer(self, optimizer_class, **kwargs)

    def _assert_idle(self, what: str) -> None:
        assert self._state is ReduceState.IDLE, (
            f"{what} while gradient reduction is queued ({self._state.value}): call it after "
            f"loss.backward() has returned")

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """All-gather every rank's chunks into the full parameters (after an optimizer step)."""
        self._assert_idle("gather_parameters()")
        for flat, gathered in zip(self._flats, self._all_gather(lambda s: s.shard), strict=True):
            for slot in flat.slots:
                slot.param.copy_(self._unshard(gathered, slot))

    def _all_gather(self, chunk_of) -> list[Tensor]:
        """For each flat shard: ``(W, numel)`` of every rank's chunks picked by ``chunk_of``."""
        out = []
        for flat in self._flats:
            mine = flat.params.new_zeros(flat.numel)
            for slot in flat.slots:
                chunk = chunk_of(slot)
                if chunk is not None:
                    mine[slot.offset:slot.offset + slot.chunk] = chunk.detach()
            gathered = mine.new_empty(self.world_size * flat.numel)
            _all_gather_single(gathered, mine, group=self.process_group)
            out.append(gathered.view(self.world_size, flat.numel))
        return out

    @staticmethod
    def _unshard(gathered: Tensor, slot: _Slot) -> Tensor:
        cols = gathered[:, slot.offset:slot.offset + slot.chunk]
        return cols.reshape(-1)[:slot.numel].view_as(slot.param).clone()

    # --- reading full state (the conformance suite's view) ----------------------------------
    def full_gradients(self) -> dict[str, Tensor | None]:
        """Unsharded gradients by parameter name; ``None`` where no gradient was reduced.

        Collective: every rank of the group must call it. Gradients accumulated under
        ``no_sync()`` and not yet reduced are not included (they are local until the next
        synced backward).
        """
        self._assert_idle("full_gradients()")
        result: dict[str, Tensor | None] = {n: None for n, _ in self.module.named_parameters()}
        gathered = self._all_gather(lambda s: s.shard.grad)
        for flat, g in zip(self._flats, gathered, strict=True):
            for slot in flat.slots:
                if slot.shard is not None and slot.shard.grad is not None:
                    result[slot.name] = self._unshard(g, slot)
        return result

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the sharded gradients by their *global* norm (one all-reduce); returns the norm.

        Padding is zero, so the shards' norms add up to the full gradient's; clipping each
        shard by its own norm instead is pytorch/pytorch#170862's bug.
        """
        self._assert_idle("clip_grad_norm_()")
        grads = [s.shard.grad for s in self._slots if s.shard is not None and s.shard.grad is not None]
        device = self._flats[0].params.device if self._flats else torch.device("cpu")
        return clip_shards_(grads, max_norm, norm_type, self.process_group, device)

    def local_shards(self) -> dict[str, tuple[Tensor, Tensor | None]]:
        """This rank's (parameter chunk, gradient chunk) by name, padding included ([Note: shard layout])."""
        return {s.name: (s.shard.detach(), None if s.shard.grad is None else s.shard.grad.detach())
                for s in self._slots if s.shard is not None}

    def full_parameters(self) -> dict[str, Tensor]:
        """Full parameters by name (copies). Every rank holds them already; no communication."""
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}
