"""State dicts of the sharded area's engines, the way each engine's users save and load them.

A state-dict round trip (issue #26; runner: `conformance.runners.sharded_checkpoint`) needs,
per engine, the model + optimizer state in two forms:

* ``"sharded"`` — each rank's part, as DTensors, for ``torch.distributed.checkpoint``;
* ``"full"`` — unsharded tensors (what a single-process ``load_state_dict`` reads).

torch FSDP1/FSDP2: ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict`` (the API FSDP2's docs point to; FQN-keyed, DTensor shards, and it creates a
fresh optimizer's state so ``dcp.load`` has entries to fill). refimpl: its own
``refimpl.sharded.checkpoint`` (same layout: ``{"model": ..., "optim": ...}``).
"""

from __future__ import annotations

KINDS = ("sharded", "full")


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown state-dict kind {kind!r}; one of {KINDS}")


def refimpl_state(engine, kind: str, optimizer) -> dict:
    from refimpl.sharded import checkpoint

    _check(kind)
    return (checkpoint.sharded_state_dict if kind == "sharded" else checkpoint.full_state_dict)(engine, optimizer)


def refimpl_load(engine, kind: str, state: dict, optimizer) -> None:
    from refimpl.sharded import checkpoint

    _check(kind)
    checkpoint.load_state_dict(engine, state, optimizer)


def _options(kind: str):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=kind == "full")


def torch_state(module, kind: str, optimizer) -> dict:
    """FSDP1 (the root ``FullyShardedDataParallel``) or FSDP2 (the ``fully_shard``-ed module)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _check(kind)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(module, options=_options(kind))}
    model, optim = get_state_dict(module, optimizer, options=_options(kind))
    return {"model": model, "optim": optim}


def torch_load(module, kind: str, state: dict, optimizer) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    _check(kind)
    if optimizer is None:
        set_model_state_dict(module, state["model"], options=_options(kind))
        return
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(kind))
