"""The straight-through check at 3+ ranks, judged by the accumulated envelope.

[Note: the accumulated envelope]
Re-anchored, every step k is judged from the engine's own verified state θ_{k-1}: its synced
gradient ĝ_k must be, per element, one of the envelope's candidates c (a summation order of the
ranks' shares), and θ_k must be bitwise Step(θ_{k-1}, ĝ_k). The straight-through check compares
the same run with the oracle trained from the seeds, θ*_k = Step(θ*_{k-1}, g*_k). At two ranks
the two coincide (one order). From three ranks the engine's choice of order at step k moves θ_k
by a few ulps, and every later step carries that move through the network and the optimizer:
the old band (16·W·eps relative) is not derived from anything, and Llama's large gradients
outgrow it by the second SGD step although every step is bitwise to an order (a false failure).

An a-priori bound would propagate each step's envelope by the step's Lipschitz factor
(1 + lr·||∇²L|| for SGD); for a network no such constant is known in advance. But it need not
be assumed: the re-anchored oracle computes the reference step from the engine's verified state,
so the propagated part is measured exactly. Per element, with r_k the rank-order reference
gradient at θ_{k-1} and R_k = Step(θ_{k-1}, r_k):

    |θ_k - θ*_k| <= |R_k - θ*_k|  +  max_c |Step(θ_{k-1}, c) - R_k|
                    (every earlier    (this step's own order choice, through the optimizer step:
                     step's verified   the per-element optimizers here (SGD, Adam, AdamW) are
                     choices, carried  elementwise, so stepping with candidate j everywhere gives
                     through one step) every element's value for that element's candidate)
    |ĝ_k - g*_k| <= |r_k - g*_k|  +  max_c |c - r_k|

and for a value without a cross-rank sum (a no_sync gradient, a buffer) the width is 0. It holds
for every correct engine by the triangle inequality, so it cannot fail one; it is not met by an
arbitrary value: at the first step R_1 = θ*_1 and r_1 = g*_1, so a zero (or stale, or doubled)
gradient must lie within one envelope width of the truth, and at any later step within the
measured carry-over plus that width (tests/conformance/test_trajectory.py runs the
stale-gradient mutant on a multi-step 3-rank case). What it does not do is judge more than the
chain of re-anchored steps does: at 3+ ranks a straight-through run is correct exactly when every
step from the previous one's verified state is. The check says how far from the seeds' trajectory
that chain led, and fails where it leaves the accumulated envelope.

Where the reference step cannot be replayed per candidate (a declared loss scaler, fp32 master
weights, simulated lossy communication, the production-training features' own oracle, an Adam
step over a derived radius: see `replayable`) the straight-through check keeps its band.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import torch
from torch import Tensor

from conformance.oracle.envelope import Envelope, reference

RULE = "accumulated-envelope"
FORMULA = ("|x - s*| <= |a - s*| + w: s* the oracle trained from the seeds, a the re-anchored reference from the "
           "engine's verified state, w this event's envelope width (through the optimizer step for parameters)")
# The float64 sum |a - s*| + w rounds once: half an ulp of float64, relative.
SLACK = 2.0**-52


def replayable(avg: dict, optimizer) -> bool:
    """Whether the step can be replayed for every accepted gradient: each reduced gradient is exact or an
    envelope of enumerated orders, or (SGD only) a derived radius, whose two ends bound the step.

    [Note: why the ends of a radius suffice for SGD] Per element SGD's step (momentum, weight decay,
    Nesterov) is a chain of roundings of sums and products with fixed factors: monotone in g, so over an
    interval of gradients the farthest steps are those of its ends. Adam's m/(sqrt(v)+eps) is not
    monotone in g (its derivative changes sign with the moments), so an Adam step over a radius keeps
    the band. Sums of more than four shares (3 ranks x 2 micro-batches reduced one by one) have a radius.
    """
    sgd = isinstance(optimizer, torch.optim.SGD)
    return all(not isinstance(v, Envelope) or (v.radius is None and v.candidates is not None) or
               (sgd and v.radius is not None and bool(torch.isfinite(v.radius).all())) for v in avg.values())


def _accepted(value) -> list[Tensor | None]:
    """The gradients whose steps bound every accepted one: each candidate order, and a radius's two
    ends rounded outwards to the gradient's dtype (a step there is at least as far; SGD is monotone)."""
    if not isinstance(value, Envelope):
        return [value]
    out = list(value.candidates) if value.candidates is not None else []
    if value.radius is not None:
        dtype = value.reference.dtype
        for sign, toward in ((-1, -math.inf), (1, math.inf)):
            end = value.center + sign * value.radius
            cast = end.to(dtype)
            beyond = cast.double() * sign >= end * sign
            out.append(torch.where(beyond, cast, torch.nextafter(cast, torch.full_like(cast, toward))))
    return out


def _candidate(accepted: list, j: int) -> Tensor | None:
    return accepted[min(j, len(accepted) - 1)]


def reach(optimizer, named: list, avg: dict) -> dict[str, tuple[Tensor, Tensor]]:
    """Per parameter, (R, E): the step with the reference gradient, and per element the widest
    distance from R of a step with any candidate order; the optimizer and parameters restored."""
    params = [p for _, p in named]
    saved_params = [p.detach().clone() for p in params]
    saved_state = copy.deepcopy(optimizer.state_dict())

    def step_with(grads: list) -> list[Tensor]:
        with torch.no_grad():
            for p, s in zip(params, saved_params, strict=True):
                p.copy_(s)
        optimizer.load_state_dict(copy.deepcopy(saved_state))
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.detach().clone().to(p.dtype)
        optimizer.step()
        return [p.detach().clone() for p in params]

    ref = step_with([reference(avg[n]) for n, _ in named])
    width = [torch.zeros(p.shape, dtype=torch.float64, device=p.device) for p in params]
    accepted = {n: _accepted(avg[n]) for n, _ in named}
    count = max((len(a) for n, a in accepted.items() if isinstance(avg[n], Envelope)), default=0)
    for j in range(count):
        stepped = step_with([_candidate(accepted[n], j) for n, _ in named])
        width = [torch.maximum(w, (s.double() - r.double()).abs()) for w, s, r in zip(width, stepped, ref, strict=True)]
    with torch.no_grad():
        for p, s in zip(params, saved_params, strict=True):
            p.copy_(s)
    optimizer.load_state_dict(saved_state)
    optimizer.zero_grad(set_to_none=True)
    return {n: (r, w) for (n, _), r, w in zip(named, ref, width, strict=True)}


def _width(value) -> Tensor | None:
    """Per element, how far an accepted value may lie from the envelope's reference (0 for a tensor)."""
    if not isinstance(value, Envelope):
        return None
    ref = value.reference.double()
    widths = []
    if value.candidates is not None:
        widths.append((value.candidates.double() - ref).abs().nan_to_num(0.0).max(0).values)
    if value.radius is not None:
        widths.append((value.center - ref).abs() + value.radius)
    return torch.stack(widths).max(0).values


def _bound(anchored, straight, carried: tuple[Tensor, Tensor] | None = None):
    """The accumulated envelope of one tensor: around the straight-through value s*, radius
    |a - s*| + w (a, w: the re-anchored reference and width, or the reference step R and E)."""
    s = reference(straight)
    if s is None or anchored is None:
        return straight
    a, w = carried if carried is not None else (reference(anchored), _width(anchored))
    center = s.double()
    radius = (a.double() - center).abs() + (0.0 if w is None else w)
    radius = radius * (1 + SLACK)
    return Envelope(s, RULE, FORMULA, center=center, radius=radius, magnitude=radius, unit=2.0**-53)


def _dict(anchored: dict | None, straight: dict | None, carried: dict | None = None) -> dict | None:
    if straight is None or anchored is None:
        return straight
    return {n: _bound(anchored.get(n), v, (carried or {}).get(n)) for n, v in straight.items()}


def accumulated(anchored, straight):
    """The straight-through oracle with every value replaced by its accumulated envelope, or None
    where the re-anchored oracle could not replay every step per candidate (then the band judges)."""
    if anchored.reach is None or len(anchored.events) != len(straight.events):
        return None
    events = []
    for a, s in zip(anchored.events, straight.events, strict=True):
        if (a.kind, a.step, a.micro) != (s.kind, s.step, s.micro):
            return None
        carried = anchored.reach.get(a.step) if a.kind == "step" else None
        if a.kind == "step" and carried is None:
            return None
        per_rank = [_dict(ar, sr, carried) for ar, sr in zip(a.per_rank, s.per_rank, strict=True)]
        buffers = [_dict(ab, sb) for ab, sb in zip(a.buffers, s.buffers, strict=True)] if a.buffers and s.buffers \
            else s.buffers
        events.append(replace(s, per_rank=per_rank, buffers=buffers))
    return replace(straight, events=events)
