"""Which parameters can (not) get a gradient, and the errors that name them.

``find_unused_parameters`` needs to know, before backward runs, which parameters no
forward output depends on, so their buckets can be completed early with zeros. That is a
walk of the autograd graph from the outputs (``grad_fn`` -> ``next_functions``) down to the
``AccumulateGrad`` nodes, whose ``variable`` is the parameter.

The messages live here so each says what went wrong *and* what to pass instead.

[Note: the used map] The reducer's used map (``Reducer._used``) records which parameters
got a gradient on this rank since the last synced backward, *including* ``no_sync``
micro-batches (pytorch/pytorch#69031). It
is all-reduced with find_unused_parameters so a parameter no rank used keeps its ``.grad``
untouched (``None`` stays ``None``), while one used by some ranks gets the average with zero
contributions from the others.

[Note: a rank that uses no parameter] With find_unused_parameters, a rank whose forward
reaches no parameter at all gets no gradient hook in its backward, so nothing would ever
launch its buckets and the other ranks would wait forever or mismatch collectives
(pytorch/pytorch#40566). The graph walk tells us this at the end of forward, so the reducer
contributes zeros for every bucket right there, in bucket order, and finalizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..nested import find_tensors

__all__ = [
    "marked_twice_error",
    "static_count_error",
    "static_missing_error",
    "unfinished_reduction_error",
    "unreached_params",
    "unused_parameters_error",
]


def _reachable_leaves(outputs):
    """Every leaf tensor the autograd graph of ``outputs`` reaches (outputs that are leaves too)."""
    stack, seen = [], set()
    for t in find_tensors(outputs):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        else:
            yield t
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == "CheckpointFunctionBackward":
            raise RuntimeError(
                "find_unused_parameters=True cannot see the parameters inside a reentrant activation "
                "checkpoint (torch.utils.checkpoint with use_reentrant=True hides them until backward): "
                "use use_reentrant=False, or static_graph=True instead of find_unused_parameters"
            )
        var = getattr(fn, "variable", None)
        if var is not None:  # AccumulateGrad: a leaf
            yield var
            continue
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None and nxt not in seen)


def unreached_params(outputs: Sequence[torch.Tensor], index_of: Mapping[int, int], n: int) -> list[int]:
    """Indices of parameters (``index_of``: ``id(param) -> index``) no output depends on."""
    reached = [False] * n
    for leaf in _reachable_leaves(outputs):
        i = index_of.get(id(leaf))
        if i is not None:
            reached[i] = True
    return [i for i, r in enumerate(reached) if not r]


def reaches_any(outputs, param_ids: set[int]) -> bool:
    """Whether any tensor in ``outputs`` (nested in tuples, lists, dicts) depends on a parameter.

    Stops at the first parameter found, so it is cheap for ordinary models; it exists for the
    rank whose forward uses no parameter at all (pytorch/pytorch#40566).
    """
    return any(id(leaf) in param_ids for leaf in _reachable_leaves(outputs))


def unused_parameters_error(names: list[str]) -> RuntimeError:
    return RuntimeError(
        f"parameters {names} did not receive a gradient in this backward, so their buckets could "
        "not be reduced (no optimizer step may use these gradients). If they are legitimately "
        "unused, pass find_unused_parameters=True to DistributedDataParallel."
    )


def unfinished_reduction_error(pending: list[str]) -> RuntimeError:
    return RuntimeError(
        "Expected to have finished reduction in the prior iteration before starting a new one: "
        f"the last backward never finished (parameters without a gradient: {pending}). "
        "If some parameters are unused in forward, pass find_unused_parameters=True to "
        "DistributedDataParallel; make sure every forward output takes part in the loss."
    )


def marked_twice_error(name: str, marked_unused: bool) -> RuntimeError:
    why = (
        "find_unused_parameters marked it unused (no forward output depends on it), yet it "
        "received a gradient: it was used outside the DDP forward's outputs"
        if marked_unused
        else "its gradient hook fired twice in one backward (a reentrant backward, e.g. "
        "activation checkpointing with use_reentrant=True, or the parameter used in several "
        "forwards before one backward)"
    )
    return RuntimeError(
        f"parameter {name!r} was marked ready twice in one backward: {why}. "
        "If the graph is the same every iteration, pass static_graph=True."
    )


def static_count_error(name: str, count: int, expected: int) -> RuntimeError:
    return RuntimeError(
        f"static_graph=True, but parameter {name!r} received {count} gradients in this backward "
        f"where the first iteration had {expected}; the graph is not static"
    )


def static_missing_error(names: list[str]) -> RuntimeError:
    return RuntimeError(
        f"static_graph=True, but parameters {names} got fewer gradients than in the first "
        "iteration; the graph is not static"
    )
