"""``DistributedDataParallel``: a drop-in for ``torch.nn.parallel.DistributedDataParallel``.

The wrapper owns what happens around the wrapped module's forward (buffer broadcast, the
reducer's per-iteration preparation, ``no_sync``); the gradient averaging itself lives in
``refimpl.ddp.reducer`` and its bucket plan in ``refimpl.ddp.plan``.

Usage::

    >>> from refimpl import DistributedDataParallel as DDP
    >>> ddp = DDP(model, process_group=pg, find_unused_parameters=True)
    >>> with ddp.no_sync():          # accumulate locally ...
    ...     ddp(x0).sum().backward()
    >>> ddp(x1).sum().backward()     # ... and average the total here
    >>> ddp.get_backward_stats().overlap_fraction()

The process group is resolved once, at construction (``dist.group.WORLD`` when none is
given); nothing is kept in module-level state, so several instances on different groups
coexist.

Production features, as in torch: uneven inputs with ``ddp.join()`` or
``torch.distributed.algorithms.Join`` (``refimpl.ddp.join``); ``torch.autocast`` and
``torch.amp.GradScaler`` need nothing from the wrapper (gradients are reduced in the
parameters' dtype); activation checkpointing (non-reentrant always; reentrant too, and
where a parameter's gradient arrives in several reentrant segments, with
``static_graph=True``); ``state_dict()`` keys carry the ``module.`` prefix and the wrapper
pickles (``torch.save(ddp)``) on the default group, rebuilding its reducer on load;
``mixed_precision`` with a ``reduce_dtype`` (torch's ``_MixedPrecision(reduce_dtype=...)``)
reduces gradients in that dtype and casts them back (``refimpl.ddp.mixed_precision``).

[Note: torch.compile] ``torch.compile(ddp)`` compiles only the wrapped module's forward: the
wrapper's bookkeeping before and after it (``_pre_forward`` / ``_post_forward``: join
collectives, buffer broadcast, reducer preparation) is excluded from tracing with
``torch.compiler.disable`` (applied when a compiled region first calls it: importing dynamo
costs seconds), so it runs eagerly, exactly as without compile.
``DDP(torch.compile(model))`` needs nothing. In both, the compiled backward (AOT autograd)
returns every parameter's gradient at once at its end; the reducer's per-parameter
post-accumulate-grad hooks then fire eagerly, one per parameter, and buckets launch as they
fill: the same gradients as eager, with less overlap of communication and backward.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from .._torch_compat import eager_under_compile
from ..broadcast import broadcast_from_rank0
from ..nested import find_tensors, move_to
from .join import DDPJoinHook, find_common_rank
from .mixed_precision import reduce_precision_hook
from .plan import DEFAULT_BUCKET_CAP_BYTES
from .reducer import Reducer
from .stats import BackwardStats

__all__ = ["DistributedDataParallel"]

# Keywords of torch's DDP that refimpl does not implement: passing a non-default value is an
# error (a silently ignored option would train differently from what the user asked for).
_UNSUPPORTED = {
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "device_mesh": None,
    "skip_all_reduce_unused_params": False,
    "bucket_cap_mb_list": None,
}


class DistributedDataParallel(nn.Module, Joinable):
    """Average gradients across a process group during backward (see module docstring).

    Differences from torch, on purpose: a parameter that gets no gradient without
    ``find_unused_parameters=True`` raises at the end of *that* backward (torch waits for the
    next forward); ``check_reduction`` is accepted and ignored as in torch (the reducer always
    checks); ``batched_grad_copy`` is accepted and has no effect (results are identical).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids=None,
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        forward_sync_buffers: bool | None = None,
        batched_grad_copy: bool = False,
        mixed_precision=None,
        **kwargs,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        self._divide_by_initial_world_size = True
        _check_unsupported(kwargs)
        if check_reduction:
            warnings.warn(
                "check_reduction is deprecated (as in torch) and ignored: the reducer always checks "
                "that every parameter was reduced",
                FutureWarning,
                stacklevel=2,
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs an initialized process group: call "
                "torch.distributed.init_process_group(...) first or pass process_group="
            )
        if isinstance(module, DistributedDataParallel) or type(module).__name__ == "DistributedDataParallel":
            raise ValueError("the module is already wrapped in DistributedDataParallel")
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        params = [(n, p) for n, p in params if n not in ignore]
        if not params:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module has no parameter that requires a gradient"
            )
        devices = {p.device for _, p in params}
        if device_ids is not None:
            _check_device_ids(device_ids, devices)
        self.module = module
        self.device_ids = list(device_ids) if device_ids is not None else None
        self.output_device = output_device
        self.dim = dim
        self.device = next(iter(devices)) if len(devices) == 1 else None
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.broadcast_buffers = broadcast_buffers
        self.forward_sync_buffers = broadcast_buffers if forward_sync_buffers is None else forward_sync_buffers
        init_sync_buffers = broadcast_buffers if forward_sync_buffers is None else True
        self.bucket_bytes_cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._ignore = ignore
        self._init_sync_buffers = init_sync_buffers
        self._buffers_to_sync = _unique(b for n, b in module.named_buffers() if n not in ignore)

        if init_sync:
            self._sync_module_states(0)
        self.mixed_precision = mixed_precision
        self.reducer = self._build_reducer()

    def _build_reducer(self) -> Reducer:
        params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad and n not in self._ignore]
        sparse_weights = {
            id(m.weight)
            for m in self.module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        }
        reducer = Reducer(
            [p for _, p in params],
            [n for n, _ in params],
            self.process_group,
            bucket_cap_bytes=self.bucket_bytes_cap or DEFAULT_BUCKET_CAP_BYTES,
            expect_sparse_gradient=[id(p) in sparse_weights for _, p in params],
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
        )
        hook = reduce_precision_hook(self.mixed_precision, [p for _, p in params])
        if hook is not None:
            reducer.register_comm_hook(self.process_group, hook)
        return reducer

    def _sync_module_states(self, group_src: int) -> None:
        """Parameters (and buffers, where construction syncs them) from group rank ``group_src``."""
        states = [p for n, p in self.module.named_parameters() if n not in self._ignore]
        if self._init_sync_buffers:
            states += self._buffers_to_sync
        broadcast_from_rank0(_unique(states), self.process_group, group_src)

    # ---------------------------------------------------------------- forward
    def forward(self, *inputs, **kwargs):
        sync = self._pre_forward()
        if self.device_ids:
            device = self.device
            inputs = move_to(inputs, device, non_blocking=True)
            kwargs = move_to(kwargs, device, non_blocking=True)
        output = self.module(*inputs, **kwargs)
        self._post_forward(output, sync)
        return output

    @eager_under_compile
    def _pre_forward(self) -> bool:
        """Collectives and reducer preparation before the module runs (see [Note: torch.compile])."""
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._join_config.enable:
            self._join_pre_forward(sync)
        if sync:
            self.reducer.prepare_for_forward()
        else:
            self.reducer.skip_backward()
        if self._sync_buffers_this_forward():
            self._broadcast_buffers(active=True)
        return sync

    @eager_under_compile
    def _post_forward(self, output, sync: bool) -> None:
        if sync:
            self.require_forward_param_sync = True
            tensors = list(find_tensors(output))
            walk = self.find_unused_parameters and not self.static_graph
            self.reducer.prepare_for_backward(tensors if walk else ())
            self.reducer.attach_to_outputs(tensors)
        else:
            self.require_forward_param_sync = False

    def _sync_buffers_this_forward(self) -> bool:
        return bool(self.require_forward_param_sync and self.forward_sync_buffers and self._buffers_to_sync)

    def _broadcast_buffers(self, active: bool) -> None:
        """Rank 0's buffers win (e.g. BatchNorm running stats), as in torch; under join the
        highest active rank's (rank 0 may have joined with stale buffers)."""
        src = 0
        if self._join_config.enable:
            src = find_common_rank(dist.get_rank(self.process_group), active, self.process_group, self.join_device)
        broadcast_from_rank0(self._buffers_to_sync, self.process_group, src)

    # ----------------------------------------------------------- join (uneven inputs)
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs across ranks (torch's signature; ``refimpl.ddp.join``)."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> DDPJoinHook:
        return DDPJoinHook(self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device if self.device is not None else torch.device("cpu")

    @property
    def join_process_group(self):
        return self.process_group

    def _check_joinable(self) -> None:
        if self.static_graph or any(b.sparse for b in self.reducer.plan):
            raise RuntimeError(
                "refimpl DistributedDataParallel does not support join (uneven inputs) with static_graph=True "
                "or sparse gradients; drop static_graph / use dense embeddings, or give every rank the same "
                "number of batches"
            )

    def _join_pre_forward(self, sync: bool) -> None:
        """An active rank's side of join (see ``refimpl.ddp.join`` for the collective sequence)."""
        work = Join.notify_join_context(self)
        if work is not None and sync and not self._divide_by_initial_world_size:
            work.wait()
            self.reducer.set_divide_factor(int(work.result()[0].item()))
        flag = torch.ones(1, device=self.join_device) if sync else torch.zeros(1, device=self.join_device)
        dist.all_reduce(flag, group=self.process_group)

    # ----------------------------------------------------------------- pickle
    def __getstate__(self) -> dict:
        if self.process_group is not dist.group.WORLD:
            raise RuntimeError(
                "only a DistributedDataParallel on the default process group can be pickled "
                "(a process group cannot be); pickle .module instead"
            )
        state = self.__dict__.copy()
        del state["process_group"], state["reducer"]
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickled on the default group with a fresh reducer (comm hooks are not kept, as in torch)."""
        super().__setstate__(state)
        self.process_group = dist.group.WORLD
        self.reducer = self._build_reducer()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate locally; the next synced backward averages the total."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # ------------------------------------------------------------ comm hooks
    def register_comm_hook(self, state: object, hook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]`` (torch's signature)."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        try:
            n_args = len(inspect.signature(hook).parameters)
        except (TypeError, ValueError):
            n_args = 2
        if n_args != 2:
            raise ValueError(f"comm hook must take (state, bucket), got a callable with {n_args} parameters")
        self.reducer.register_comm_hook(state, hook)

    # ----------------------------------------------------------------- stats
    def get_backward_stats(self) -> BackwardStats:
        """Per-parameter ready times and per-bucket launch/finish times of the last backward."""
        return self.reducer.get_backward_stats()

    @property
    def bucket_plan(self):
        return self.reducer.plan


def _check_unsupported(kwargs: dict) -> None:
    """torch's keywords refimpl does not implement: accepted only at torch's default."""
    for name, value in kwargs.items():
        if name not in _UNSUPPORTED:
            raise TypeError(f"DistributedDataParallel got an unexpected keyword argument {name!r}")
        if value != _UNSUPPORTED[name]:
            raise ValueError(
                f"refimpl DistributedDataParallel does not support {name}={value!r}; "
                f"leave it at {_UNSUPPORTED[name]!r} or use torch.nn.parallel.DistributedDataParallel"
            )


def _check_device_ids(device_ids, devices: set) -> None:
    """`device_ids` names the one GPU that holds every parameter (torch's single-device rule)."""
    if len(device_ids) != 1:
        raise ValueError(f"device_ids must hold exactly one device (one process per device), got {device_ids}")
    if len(devices) != 1 or next(iter(devices)).type == "cpu":
        raise ValueError(
            "device_ids is only for single-device GPU modules; leave it None for CPU or multi-device modules "
            f"(module parameters are on {sorted(map(str, devices))})"
        )
    want = torch.device(device_ids[0]) if not isinstance(device_ids[0], int) else None
    device = next(iter(devices))
    if want is not None and want != device or want is None and device.index != device_ids[0]:
        raise ValueError(f"device_ids={device_ids} but the module's parameters are on {device}")


def _unique(tensors) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
