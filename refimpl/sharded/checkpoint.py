"""Checkpoints of refimpl's sharded engines that ``torch.distributed.checkpoint`` (DCP) can save.

Why DTensors: DCP writes each rank's part of a tensor once and reads back whatever part a rank
asks for, but only if every entry says which part of which global tensor it is. A ``DTensor``
says that with torch's own vocabulary, so refimpl's shards go to DCP as DTensors and refimpl
still depends on torch only. Each trainable parameter (and each per-element optimizer state:
Adam's moments, SGD's momentum) is saved as a 1-D DTensor of ``numel`` elements with placement
``Shard(0)`` over the engine's group: that is exactly refimpl's ``flat-chunk`` layout (rank r
holds ``[r*c, (r+1)*c)`` with ``c = ceil(numel / W)``) without the padding, which is no data.
Because DCP knows the global shape, a checkpoint saved at one world size loads at another.

The layout of a state dict (``get_state_dict``'s, FQN-keyed)::

    {"model": {name: DTensor (trainable, flat) | Tensor (buffers, frozen parameters)},
     "optim": {"state": {name: {key: DTensor (per element) | Tensor (scalars, e.g. Adam's step)}},
               "param_groups": [{hyperparameters..., "params": [names]}]}}

``full_state_dict`` is the same with every DTensor gathered to its full tensor in the
parameter's shape (a collective): what a single-process ``load_state_dict`` reads, and what
loads into an engine of any world size. ``load_state_dict`` takes either.

Works with ``ShardedDataParallel`` (ZeRO-2) and ``FullyShardedDataParallel`` (ZeRO-3) through
their public reads (``local_shards``, ``sharded_parameters``, ``gather_parameters``); the
optimizer is the engine's ``ShardedOptimizer``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["full_state_dict", "load_state_dict", "sharded_state_dict"]


def _mesh(engine):
    from torch.distributed.device_mesh import DeviceMesh

    device = next((p.device for p in engine.sharded_parameters()), torch.device("cpu"))
    return DeviceMesh.from_group(engine.process_group, device.type)


def _shards(engine) -> dict[str, tuple[nn.Parameter, torch.Size]]:
    """name -> (this rank's chunk as the optimizer's parameter, the full parameter's shape).

    Matched by storage address: ``local_shards()`` returns detached views of the same chunks that
    ``sharded_parameters()`` hands to the optimizer. A parameter's shape survives ZeRO-3's
    freeing (only its storage is resized), so it is read from the module.
    """
    placed = [q.name for q in getattr(engine, "_params", ()) if getattr(q, "dim", 0)]
    if placed:  # chunks in placement order (refimpl.sharded.placement): not the flat layout DCP sees
        raise ValueError(f"{placed} are sharded on a dim other than 0 (shard_placement_fn); these state dicts keep "
                         "the flat-chunk layout: use the engine's full_state_dict() / load_full_state_dict()")
    by_ptr = {(p.data_ptr(), p.numel()): p for p in engine.sharded_parameters() if p.numel()}
    shapes = {n: p.shape for n, p in engine.module.named_parameters()}
    out = {}
    for name, (chunk, _) in engine.local_shards().items():
        if chunk.numel() and (chunk.data_ptr(), chunk.numel()) in by_ptr:
            out[name] = (by_ptr[(chunk.data_ptr(), chunk.numel())], shapes[name])
    return out


def _valid(chunk: int, numel: int, rank: int) -> int:
    """How many of this rank's ``chunk`` elements are real (the rest is padding)."""
    return max(0, min(chunk, numel - rank * chunk))


def _dtensor(local_chunk: Tensor, numel: int, engine, mesh):
    from torch.distributed.tensor import DTensor, Shard

    rank = engine.rank
    part = local_chunk.detach()[:_valid(local_chunk.numel(), numel, rank)].clone()
    return DTensor.from_local(part, mesh, [Shard(0)], run_check=False, shape=(numel,), stride=(1,))


def _init_optimizer_state(optimizer) -> None:
    """Create the optimizer's state so a load has entries to fill: one step on zero gradients
    with the learning rate at 0 (what ``torch.distributed.checkpoint.state_dict`` does for a
    fresh optimizer); the load then overwrites every value it created."""
    inner = optimizer.optimizer
    if inner.state:
        return
    params = [p for g in inner.param_groups for p in g["params"]]
    saved = [p.grad for p in params]
    lrs = [g["lr"] for g in inner.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in inner.param_groups:
        g["lr"] = 0.0
    inner.step()
    for g, lr in zip(inner.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p, g in zip(params, saved, strict=True):
        p.grad = g


def sharded_state_dict(engine, optimizer=None) -> dict:
    """This rank's part of the model (and optimizer) state, as DTensors DCP can save and load.

    No communication. With an optimizer that has not stepped yet, its state is created first
    (see ``_init_optimizer_state``), so the result is also the template ``dcp.load`` fills.
    """
    engine._assert_idle("sharded_state_dict()")
    mesh, shards = _mesh(engine), _shards(engine)
    model: dict[str, Tensor] = {}
    for name, p in engine.module.named_parameters():
        if name in shards:
            model[name] = _dtensor(shards[name][0], math.prod(shards[name][1]), engine, mesh)
        elif not p.requires_grad:
            model[name] = p.detach().clone()  # frozen: replicated, as the module holds it
    model.update({n: b.detach().clone() for n, b in engine.module.named_buffers()})
    state = {"model": model}
    if optimizer is not None:
        _init_optimizer_state(optimizer)
        inner = optimizer.optimizer
        names = {id(shard): name for name, (shard, _) in shards.items()}
        per_param = {}
        for param, entries in inner.state.items():
            name, numel = names[id(param)], math.prod(shards[names[id(param)]][1])
            per_param[name] = {k: _dtensor(v, numel, engine, mesh)
                               if isinstance(v, Tensor) and v.shape == param.shape and v.dim() == 1 else
                               (v.detach().clone() if isinstance(v, Tensor) else v)
                               for k, v in entries.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                  for g in inner.param_groups]
        state["optim"] = {"state": per_param, "param_groups": groups}
    return state


def full_state_dict(engine, optimizer=None) -> dict:
    """``sharded_state_dict`` with every DTensor gathered into its full tensor, in the parameter's
    shape, on every rank (a collective: all ranks call it)."""
    state = sharded_state_dict(engine, optimizer)
    shapes = {n: s for n, (_, s) in _shards(engine).items()}

    def full(name, value):
        if hasattr(value, "full_tensor"):
            return value.full_tensor().view(shapes[name])
        return value

    state["model"] = {n: full(n, v) for n, v in state["model"].items()}
    if "optim" in state:
        state["optim"]["state"] = {n: {k: full(n, v) for k, v in e.items()} for n, e in state["optim"]["state"].items()}
    return state


def _mine(value: Tensor, chunk: Tensor, rank: int) -> Tensor:
    """This rank's padded chunk of a saved entry: a DTensor's local part, or a slice of a full tensor."""
    c = chunk.numel()
    out = chunk.new_zeros(c)
    if hasattr(value, "to_local"):
        local = value.to_local().reshape(-1)
        out[:local.numel()] = local
    else:
        flat = value.reshape(-1)
        part = flat[rank * c:(rank + 1) * c]
        out[:part.numel()] = part
    return out


@torch.no_grad()
def load_state_dict(engine, state: dict, optimizer=None) -> None:
    """Load a ``sharded_state_dict`` (DTensors, e.g. filled by ``dcp.load``) or a ``full_state_dict``.

    Every trainable parameter's chunk, buffers and frozen parameters; with ``optimizer``, its
    per-parameter state and the param groups' hyperparameters. A missing entry is an error: a
    checkpoint that silently keeps the fresh engine's values trains on from the wrong state.
    """
    engine._assert_idle("load_state_dict()")
    shards, rank = _shards(engine), engine.rank
    model = state["model"]
    for name, p in engine.module.named_parameters():
        if name not in model:
            raise KeyError(f"the checkpoint has no entry for parameter {name!r}: it was saved from another model")
        if name in shards:
            shard = shards[name][0]
            shard.copy_(_mine(model[name], shard, rank).to(shard.dtype))
        elif not p.requires_grad:
            p.copy_(model[name])
    for name, b in engine.module.named_buffers():
        b.copy_(model[name])
    if optimizer is not None:
        if "optim" not in state:
            raise KeyError("the checkpoint has no optimizer state ('optim'): save it with the optimizer")
        _init_optimizer_state(optimizer)
        inner = optimizer.optimizer
        names = {id(shard): name for name, (shard, _) in shards.items()}
        saved = state["optim"]
        for param, entries in inner.state.items():
            name = names[id(param)]
            for k, v in entries.items():
                value = saved["state"][name][k]
                if isinstance(v, Tensor) and v.shape == param.shape and v.dim() == 1:
                    v.copy_(_mine(value, param, rank).to(v.dtype))
                elif isinstance(v, Tensor):
                    v.copy_(value)
                else:
                    entries[k] = value
        for group, saved_group in zip(inner.param_groups, saved["param_groups"], strict=True):
            if [names[id(p)] for p in group["params"]] != list(saved_group["params"]):
                raise ValueError("the checkpoint's optimizer parameter groups hold other parameters than this one's")
            group.update({k: v for k, v in saved_group.items() if k != "params"})
    engine.gather_parameters()  # ZeRO-2: every rank's full parameters from the loaded chunks
