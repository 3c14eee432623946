"""replicate: copies of a module on several devices whose gradients flow back to it.

[Note: gradient edges]
Each replica holds, in place of every parameter X of the original, a tensor produced by
one `Broadcast` autograd node whose *inputs* are the original parameters. The node's
backward is a reduce-add: it sums the gradients the replicas produced for X onto X's
device, and autograd then accumulates that sum into `X.grad` like any other gradient.
This is the seed's `ReduceAdd` edge, built with a public `torch.autograd.Function`
instead of rewiring `grad_fn` by hand. Buffers that require grad get the same edge.
With `ctx.set_materialize_grads(False)` a replica that did not use X contributes `None`,
not zeros, so a parameter no replica used keeps `grad is None`.

[Note: replicas are views, not owners]
A replica's parameters are plain (non-leaf) tensors set as attributes, not
`nn.Parameter`s: they are functions of the original parameters, valid for one forward /
backward. Policy for misuse (tested in tests/refimpl/data_parallel/test_dp_replicate.py):
- `replica.parameters()` / `named_parameters()` yield those tensors, so code inside a
  forward that reads `next(self.parameters()).device` keeps working;
- an optimizer built from them raises (torch.optim refuses non-leaf tensors), and none of
  them ever gets a `.grad` - the gradients land in the original module;
- `replicate(replica)` / `data_parallel(replica, ...)` raise `ReplicaMisuseError`;
- `replica.state_dict()` raises `ReplicaMisuseError` (it would silently miss the
  parameters); take it from the original module.

[Note: memory sharing]
A replica on the same device as the original shares memory with it: grad-requiring
tensors are autograd views of the originals, frozen parameters are detached aliases.
Buffers that do not require grad (BatchNorm running stats) are *the original tensors* in
the first replica on their device, so in-place updates made by that replica's forward
land in the original module (as replica 0 does in `torch.nn.DataParallel`); every other
replica gets its own copy, so replicas sharing a device never race on a buffer.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from .._torch_compat import MODULE_BUFFERS, MODULE_CHILDREN, MODULE_PARAMETERS
from ..nested import is_namedtuple
from .devices import DeviceLike, normalize_devices

__all__ = ["Broadcast", "ReplicaInfo", "ReplicaMisuseError", "is_replica", "replicate"]

M = TypeVar("M", bound=nn.Module)

_REPLICA_KEY = "_refimpl_replica"
_REPLICA_PARAMS_KEY = "_refimpl_replica_parameters"


class ReplicaMisuseError(RuntimeError):
    """A replica made by `replicate` was used where only the original module is valid."""


@dataclass(frozen=True)
class ReplicaInfo:
    index: int
    device: torch.device


def is_replica(module: nn.Module) -> bool:
    return _REPLICA_KEY in module.__dict__


class Broadcast(torch.autograd.Function):
    """Copy tensors to each device; backward reduce-adds the copies' grads onto the sources.

    `apply(devices, *tensors)` returns `len(devices) * len(tensors)` tensors, replica-major:
    output `j * len(tensors) + i` is tensor `i` on `devices[j]`.
    """

    @staticmethod
    def forward(ctx, devices: Sequence[torch.device], *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.num_tensors = len(tensors)
        ctx.sources = [t.device for t in tensors]
        outputs = []
        for device in devices:
            for t in tensors:
                # Same device: a view (no copy); autograd still routes its grad through us.
                outputs.append(t.view_as(t) if t.device == device else t.to(device))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        n = ctx.num_tensors
        summed: list[torch.Tensor | None] = []
        for i in range(n):
            total = None
            owned = False  # may we add in place into `total`?
            for g in grads[i::n]:  # replica order: a fixed, deterministic summation order
                if g is None:
                    continue
                g = g.to(ctx.sources[i])
                if total is None:
                    total = g
                elif owned and not torch.is_grad_enabled():
                    total.add_(g)
                else:  # never write into a gradient buffer the engine handed us
                    total = total + g
                    owned = True
            summed.append(total)
        return (None, *summed)


def _check_replicable(module: nn.Module) -> None:
    if is_replica(module):
        info = module.__dict__[_REPLICA_KEY]
        raise ReplicaMisuseError(
            f"this module is replica {info.index} (on {info.device}) made by replicate(); "
            "replicating a replica would detach the copies from the original parameters. "
            "Pass the original module instead."
        )
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError("replicate does not support ScriptModules; replicate the eager module")
    for name, p in module.named_parameters():
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ValueError(
                f"parameter {name!r} is uninitialized (lazy module): run one forward on the "
                "original module before replicating it"
            )


def _named_replica_parameters(replica_ref):
    def named_parameters(prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        root = replica_ref()
        modules = root.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse else [(prefix, root)]
        seen: set[int] = set()
        for mod_prefix, mod in modules:
            for key, t in mod.__dict__.get(_REPLICA_PARAMS_KEY, {}).items():
                if remove_duplicate:
                    if id(t) in seen:
                        continue
                    seen.add(id(t))
                yield (mod_prefix + "." + key if mod_prefix else key), t

    return named_parameters


def _replica_parameters(replica_ref):
    def parameters(recurse: bool = True) -> Iterator[torch.Tensor]:
        for _, t in replica_ref().named_parameters(recurse=recurse):
            yield t

    return parameters


def _replica_state_dict(*args, **kwargs):
    raise ReplicaMisuseError(
        "state_dict() of a replica made by replicate() would miss its parameters (they are "
        "not nn.Parameters); take the state_dict of the original module"
    )


def _shallow_copy(module: nn.Module, info: ReplicaInfo) -> nn.Module:
    replica = module.__class__.__new__(module.__class__)
    state = module.__dict__.copy()
    state[MODULE_PARAMETERS] = {}
    state[MODULE_BUFFERS] = dict(state[MODULE_BUFFERS])
    state[MODULE_CHILDREN] = dict(state[MODULE_CHILDREN])
    state[_REPLICA_KEY] = info
    state[_REPLICA_PARAMS_KEY] = {}
    object.__setattr__(replica, "__dict__", state)
    # Instance attributes shadow the class methods. They hold a weak reference so a replica
    # is freed by reference counting as soon as the autograd graph lets go of it.
    ref = weakref.ref(replica)
    state["named_parameters"] = _named_replica_parameters(ref)
    state["parameters"] = _replica_parameters(ref)
    state["state_dict"] = _replica_state_dict
    return replica


def _retarget_tensor_caches(replica: nn.Module, copies: dict[int, list[torch.Tensor]], j: int) -> None:
    """Point list/tuple attributes that cache the module's own tensors at replica j's copies.

    Some modules keep a plain list of their parameters next to the registered ones - e.g.
    the RNNs' `_flat_weights`, which their forward reads instead of the attributes. The
    shallow copy would share that list with the original, so the replica would compute
    with the original parameters (wrong device, no gradient edge). Each replica gets its
    own list with the original tensors swapped for its copies; other entries are kept.
    """
    for name, value in list(replica.__dict__.items()):
        if isinstance(value, (list, tuple)) and not is_namedtuple(value):
            if any(isinstance(v, torch.Tensor) and id(v) in copies for v in value):
                swapped = [copies[id(v)][j] if isinstance(v, torch.Tensor) and id(v) in copies else v for v in value]
                replica.__dict__[name] = type(value)(swapped)


def replicate(module: M, devices: Sequence[DeviceLike], *, detach: bool = False) -> list[M]:
    """Return one replica of `module` per entry of `devices` (a device may repeat).

    Gradients of a loss computed from the replicas' outputs accumulate into the original
    module's parameters (see [Note: gradient edges]). With `detach=True` the replicas are
    cut from autograd (inference; cheaper). Python attributes that are not parameters,
    buffers or submodules are shared with the original, as in torch's DataParallel.
    """
    _check_replicable(module)
    devices = normalize_devices(devices)
    n = len(devices)

    params = list(module.parameters())  # each shared/tied Parameter once
    buffers = list(module.buffers())
    tracked = [t for t in params + buffers if t.requires_grad] if not detach else []
    tracked_ids = {id(t) for t in tracked}

    # copies[id(original)][j] = the tensor replica j uses in its place
    copies: dict[int, list[torch.Tensor]] = {}
    if tracked:
        flat = Broadcast.apply(devices, *tracked)
        for i, t in enumerate(tracked):
            copies[id(t)] = [flat[j * len(tracked) + i] for j in range(n)]
    for p in params:
        if id(p) not in tracked_ids:  # frozen: nobody writes it during forward, alias freely
            d = p.detach()
            copies[id(p)] = [d if d.device == dev else d.to(dev) for dev in devices]
    for b in buffers:
        if id(b) in tracked_ids:
            continue
        per_replica, aliased = [], False
        for dev in devices:
            if b.device == dev and not aliased:
                per_replica.append(b.detach() if detach else b)
                aliased = True
            else:
                per_replica.append(b.detach().to(dev, copy=True))
        copies[id(b)] = per_replica

    originals = list(module.modules())
    replicas = [
        {id(m): _shallow_copy(m, ReplicaInfo(j, dev)) for m in originals}
        for j, dev in enumerate(devices)
    ]
    for j in range(n):
        for m in originals:
            r = replicas[j][id(m)]
            slots, r_slots = vars(m), vars(r)  # nn.Module's own dicts (refimpl._torch_compat)
            for key, child in slots[MODULE_CHILDREN].items():
                r_slots[MODULE_CHILDREN][key] = None if child is None else replicas[j][id(child)]
            for key, p in slots[MODULE_PARAMETERS].items():
                if p is None:
                    r_slots[MODULE_PARAMETERS][key] = None
                else:
                    # A plain attribute, not a Parameter: it is not a leaf (Note: replicas).
                    object.__setattr__(r, key, copies[id(p)][j])
                    r.__dict__[_REPLICA_PARAMS_KEY][key] = copies[id(p)][j]
            for key, b in slots[MODULE_BUFFERS].items():
                r_slots[MODULE_BUFFERS][key] = None if b is None else copies[id(b)][j]
            _retarget_tensor_caches(r, copies, j)
    return [replicas[j][id(module)] for j in range(n)]
