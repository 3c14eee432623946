"""The data_parallel oracle replica by replica: each replica's gradient on the implementation's
own split, and their sum judged against the envelope of summation orders.

[Note: why per replica]
`data_parallel` runs the module on W chunks of the batch and *sums* the replicas' gradients
(no 1/W). The contract's reference is one backward over the full batch, equal to that sum in
exact arithmetic; in floating point the two differ twice over: the full batch's kernels sum
its rows in one pass where each replica sums only its chunk's, and the W replicas' partial
gradients are then added in an order the implementation picks. Judged against the full
batch, a model whose values leave the small integers (softmax, BatchNorm, an optimizer step,
autocast) needed a blanket band (`float_tolerance`, 16·rows·eps), wide enough for a replica
dropped from a sum of many rows. Here instead the oracle replays what each replica computes:

- the split is the implementation's: an adapter declares it (`chunk_sizes(rows, replicas)`,
  refimpl: `torch.tensor_split`'s balanced sizes, torch.nn.DataParallel: `torch.chunk`'s);
  an adapter that declares none is judged against both rules (`splits`), each split whole;
- replica j runs the module's forward on chunk j with its own leaf copies of the parameters
  (the same values, kernels and shapes the implementation's replica uses), replica 0 on the
  module's buffers as both implementations do, the others on copies; the outputs are
  concatenated along `dim` (0-dim ones stacked) and the same loss is backpropagated, so each
  replica's gradient, the gathered output and the inputs' gradients are bitwise what a correct
  implementation holds;
- the replicas' gradients go through `conformance.oracle.envelope.reduce` with divisor 1: order-free
  (bitwise) for one or two replicas, every summation tree at 3-4, ring orders plus the
  derived γ bound beyond; accumulation adds the previous (already judged) gradient once,
  after the sum, as autograd's AccumulateGrad does after the reduce-add.

Where the implementation declares no split, each expected value is the union over the
candidate splits (`union`): a value must still be bitwise one split's and one order's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from conformance.models.data_parallel import flatten_output, map_leaves, total_loss
from conformance.oracle.envelope import Envelope, reduce


def balanced_sizes(rows: int, replicas: int) -> tuple[int, ...]:
    """`torch.tensor_split(range(rows), min(replicas, rows))`'s sizes: larger chunks first, none empty."""
    if rows == 0:
        return (0,)
    k = min(replicas, rows)
    base, extra = divmod(rows, k)
    return (base + 1,) * extra + (base,) * (k - extra)


def chunk_sizes(rows: int, replicas: int) -> tuple[int, ...]:
    """`torch.chunk(range(rows), replicas)`'s sizes (torch.nn.DataParallel's scatter): ceil-sized, maybe fewer."""
    if rows == 0:
        return (0,)
    size = -(-rows // replicas)
    return tuple(min(size, rows - start) for start in range(0, rows, size))


def splits(adapter, rows: int, replicas: int) -> tuple[list[tuple[int, ...]], str]:
    """The splits the oracle replays: the adapter's declared one, else both standard rules."""
    declared = getattr(adapter, "chunk_sizes", None)
    if callable(declared):
        sizes = tuple(int(s) for s in declared(rows, replicas))
        if sum(sizes) != rows:
            raise ValueError(f"adapter {getattr(adapter, 'name', adapter)!r}: chunk_sizes({rows}, {replicas}) = "
                             f"{list(sizes)} does not add up to {rows} rows; return the sizes its scatter uses")
        return [sizes], "declared"
    found = list(dict.fromkeys([balanced_sizes(rows, replicas), chunk_sizes(rows, replicas)]))
    return found, "undeclared: tensor_split or chunk"


def _chunk(obj, sizes: tuple[int, ...], dim: int, j: int):
    """Chunk j of every tensor leaf (a differentiable slice, cloned as a scatter copies it)."""
    return map_leaves(obj, lambda t: torch.split(t, list(sizes), dim)[j].clone() if isinstance(t, Tensor) else t)


def _gather(outputs: list[dict], dim: int) -> dict:
    """Per-path concatenation of the replicas' flattened outputs (0-dim leaves stacked)."""
    out = {}
    for path, first in outputs[0].items():
        leaves = [o[path] for o in outputs]
        if isinstance(first, Tensor):
            out[path] = torch.stack(leaves) if first.dim() == 0 else torch.cat(leaves, dim)
        else:
            out[path] = first
    return out


@dataclass
class ReplicaPass:
    """What one split gives: the gathered output, each replica's gradients, replica 0's buffers."""

    output: dict  # flattened, by path
    grads: list[dict[str, Tensor | None]]  # per replica, by parameter name
    buffers: dict[str, Tensor]  # the module's buffers after the pass (replica 0's updates)


def replica_pass(module, inputs: tuple, module_kwargs: dict | None, sizes: tuple[int, ...], dim: int,
                 *, backward: bool = True) -> ReplicaPass:
    """Every replica of one split, forward (and backward through the gathered output).

    The module itself is not changed: parameters are copied per replica, buffers start from the
    module's for every replica and only replica 0's updates are returned."""
    start = {n: b.detach().clone() for n, b in module.named_buffers()}
    params = [(n, p) for n, p in module.named_parameters()]
    outputs, leaves, kept = [], [], start
    for j in range(len(sizes)):
        own = {n: (p.detach().clone().requires_grad_() if p.requires_grad and backward else p.detach()) for n, p in params}
        buffers = {n: b.clone() for n, b in start.items()}
        args = _chunk(inputs, sizes, dim, j)
        kwargs = _chunk(module_kwargs or {}, sizes, dim, j)
        out = torch.func.functional_call(module, {**own, **buffers}, args, kwargs)
        outputs.append(flatten_output(out))
        leaves.append(own)
        if j == 0:
            kept = buffers
    gathered = _gather(outputs, dim)
    if backward:
        loss = total_loss(gathered)
        if loss.requires_grad:
            loss.backward()
    grads = [{n: (None if t.grad is None else t.grad.detach()) for n, t in own.items()} for own in leaves]
    return ReplicaPass(gathered, grads, {n: b.detach() for n, b in kept.items()})


def summed(grads: list[dict[str, Tensor | None]], rule) -> dict[str, Tensor | Envelope | None]:
    """Σ_j replica j's gradient as the implementation may add them (divisor 1: data_parallel sums)."""
    return {name: reduce([g[name] for g in grads], 1, rule) for name in grads[0]}


def accumulate(value, old: Tensor | None):
    """`old + value` as autograd accumulates a reduce-add's result into an existing `.grad`.

    One rounding after the sum: every candidate order shifted by `old`; a derived bound's centre
    moves by `old` and its radius grows by that rounding (u·(|s| + |old|))."""
    if old is None or value is None:
        return value if old is None else old
    if isinstance(value, Tensor):
        return old + value
    shifted = replace(value, reference=old + value.reference)
    if value.magnitude is not None:  # the sum now has one more term: the earlier gradient
        shifted.magnitude = value.magnitude + old.double().abs()
    if value.candidates is not None:
        shifted.candidates = value.candidates + old
    if value.center is not None:
        shifted.center = value.center + old.double()
        shifted.radius = value.radius + value.unit * (value.center.abs() + 2 * old.double().abs() + value.radius)
    return shifted


def union(values: list):
    """One expected value accepting any of `values` (tensors or summation-order envelopes):
    a tensor where they agree bitwise, else an envelope of every candidate."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    first = values[0]
    if len(values) == 1:
        return first
    stacks, bounded = [], None
    for v in values:
        if isinstance(v, Envelope):
            if v.center is not None:  # one bound covering each split's: around the first centre
                bounded = v if bounded is None else replace(
                    bounded, radius=torch.maximum(bounded.radius, (v.center - bounded.center).abs() + v.radius))
            if v.candidates is not None:
                stacks.append(v.candidates)
        else:
            stacks.append(v.unsqueeze(0))
    ref = first.reference if isinstance(first, Envelope) else first
    candidates = torch.cat(stacks) if stacks else None
    if bounded is None and candidates is not None and bool((candidates == ref).all()):
        return ref
    base = bounded or (first if isinstance(first, Envelope) else None)
    if base is None:
        return Envelope(ref, "summation-order", f"bitwise to one of {len(values)} splits' results",
                        candidates=candidates, magnitude=ref.double().abs(),
                        unit=torch.finfo(ref.dtype).eps / 2 if ref.is_floating_point() else 1.0)
    return replace(base, candidates=candidates, formula=f"{base.formula}, over {len(values)} splits")
