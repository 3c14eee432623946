"""What a cross-rank (or cross-replica) sum may be, per element: the summation-order envelope.

[Note: why an envelope, not a band]
Floating-point addition is commutative but not associative: `(a + b) + c` and `a + (b + c)`
may differ in the last bit. Two ranks' shares have one sum, so a correct engine is bitwise
equal to the oracle; with three or more the backend's order (ring chunks, trees, halving-
doubling) decides the last bits. A blanket relative band covering that also covers an engine
that reduces in the wrong dtype or scales a gradient by 0.99. Instead the oracle keeps every
rank's own contribution (computed with the kernels the rank uses) and derives, per element:

- **summation-order** (W <= 4): the result of every summation tree over the contributions
  (1, 1, 3 and 15 distinct trees for 1-4 terms: every order and every parenthesization, so
  ring, tree and halving-doubling orders are all in it). A value is accepted if it *equals*
  one of them: "bitwise to a summation order". Beyond 4 terms: the ring orders (every
  rotation, both directions) plus the derived bound below.
- **derived-bound** (a sum rounded in a lower precision: bf16/fp16 parameters, a declared
  `reduce_dtype`, compression hooks): |ŝ - s| <= γ_m·Σ|x_i| + m·n·η, with s the exact sum of
  the contributions x_i, γ_m = m·u/(1 - m·u), u the unit roundoff of the dtype the sum is
  rounded in, m = (declared roundings per term: casts, a low-precision divide) + (n - 1)
  additions, and η half its smallest subnormal (underflow). The textbook bound of recursive
  summation (Higham, Accuracy and Stability, 2nd ed., §4.2) holds for *every* order, so no
  order needs enumerating.

Where the 1/W happens is part of the model (`Tolerance.divide`): "pre" (every rank scales its
share first, by dividing or by multiplying with fl(1/W): torch DDP does either, see
`_variants`), "post" (sum, then divide) and "split" (FSDP's gradient pre-/post-divide
factors). The envelope is the union over the declared placements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import combinations

import torch
from torch import Tensor

UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
# Half the smallest subnormal: the absolute error of one rounding into the underflow range.
UNDERFLOW = {"float64": 2.0**-1075, "float32": 2.0**-150, "bfloat16": 2.0**-134, "float16": 2.0**-25}
MAX_ENUMERATED = 4  # up to this many terms every summation tree is enumerated


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gamma(m: int, u: float) -> float:
    """γ_m = m·u / (1 - m·u): the relative error bound of m roundings (Higham, Lemma 3.1)."""
    return m * u / (1 - m * u) if m > 0 else 0.0


def fsdp_predivide(world_size: int) -> float:
    """FSDP's gradient pre-divide factor (torch.distributed.fsdp `_get_gradient_predivide_factor`)."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)


def summation_trees(terms: list[Tensor]) -> list[Tensor]:
    """The result of every summation tree over `terms` (commutativity is bitwise, so unordered splits)."""
    memo: dict[tuple[int, ...], list[Tensor]] = {}

    def trees(idx: tuple[int, ...]) -> list[Tensor]:
        if len(idx) == 1:
            return [terms[idx[0]]]
        if idx in memo:
            return memo[idx]
        first, rest, out = idx[0], idx[1:], []
        for k in range(len(rest)):
            for joined in combinations(rest, k):
                left = (first, *joined)
                right = tuple(i for i in rest if i not in joined)
                out.extend(x + y for x in trees(left) for y in trees(right))
        memo[idx] = out
        return out

    return trees(tuple(range(len(terms))))


def ring_orders(terms: list[Tensor]) -> list[Tensor]:
    """Sequential sums starting at every rank, around the ring in both directions."""
    n, out = len(terms), []
    for start in range(n):
        for step in (1, -1):
            total = terms[start]
            for k in range(1, n):
                total = total + terms[(start + step * k) % n]
            out.append(total)
    return out


def sequential(terms: list[Tensor]) -> Tensor:
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


@dataclass
class Envelope:
    """Per element, the values a correct engine may hold for one reduced tensor.

    `reference` is the rank-order sum of pre-divided shares (the value the oracle used before
    envelopes, and what the straight-through check compares with). Accepted: equal to one of
    `candidates` (stacked on dim 0), or within `radius` of `center` (float64) where a bound is
    derived.
    """

    reference: Tensor
    rule: str  # "summation-order" | "derived-bound"
    formula: str
    candidates: Tensor | None = None
    center: Tensor | None = None
    radius: Tensor | None = None
    magnitude: Tensor | None = None  # Σ|x_i| per element, float64 (the scale of the sum's rounding)
    unit: float = 2.0**-24  # unit roundoff of the dtype the sum is rounded in
    # [Note: which placement of 1/W] Where `candidates` come from several placements of 1/W
    # ("pre", "post"), `labels` names each row's, so the judge can say which one the engine
    # matched; `others` holds the candidates of the exact placements the rule does not accept
    # (a class that pinned "pre" but sums first), so a failure can say it matches one of them.
    labels: tuple[str, ...] | None = None
    others: dict[str, Tensor] | None = None

    # Tensor-like surface used by the comparison (dtype and shape checks) and by reports.
    @property
    def dtype(self) -> torch.dtype:
        return self.reference.dtype

    @property
    def shape(self) -> torch.Size:
        return self.reference.shape

    def numel(self) -> int:
        return self.reference.numel()

    def accepts(self, actual: Tensor) -> Tensor:
        """A bool tensor: which elements of `actual` lie in the envelope (NaN only where an order gives NaN)."""
        a = actual.detach().to(self.reference.device)
        ok = torch.zeros(a.shape, dtype=torch.bool, device=a.device)
        if self.candidates is not None:
            c = self.candidates
            ok |= (c == a).any(0) | (c.isnan() & a.isnan()).any(0)
        if self.center is not None:
            finite = torch.isfinite(self.center) & torch.isfinite(self.radius)
            inside = (a.double() - self.center).abs() <= self.radius
            same = (a == self.reference) | (a.isnan() & self.reference.isnan())
            ok |= torch.where(finite, inside, same)
        return ok

    def nearest(self, actual: Tensor) -> tuple[Tensor, Tensor]:
        """(nearest accepted value, distance outside the envelope) per element, float64; 0 inside."""
        a = actual.detach().to(self.reference.device).double()
        best = torch.full_like(a, math.inf)
        value = self.reference.double().clone()
        if self.candidates is not None:
            d = (self.candidates.double() - a).abs().nan_to_num(math.inf)
            dmin, arg = d.min(0)
            best, value = dmin, self.candidates.double().gather(0, arg.unsqueeze(0)).squeeze(0)
        if self.center is not None:
            lo, hi = self.center - self.radius, self.center + self.radius
            clamped = torch.minimum(torch.maximum(a, lo), hi)
            d = (a - clamped).abs().nan_to_num(math.inf)
            closer = d < best
            best, value = torch.where(closer, d, best), torch.where(closer, clamped, value)
        best = torch.where(self.accepts(actual), torch.zeros_like(best), best)
        return value, best

    def placements(self, actual: Tensor) -> list[str]:
        """The labelled placements of 1/W whose candidates explain every element of `actual`."""
        if self.labels is None or self.candidates is None:
            return []
        a = actual.detach().to(self.reference.device)
        hit = (self.candidates == a) | (self.candidates.isnan() & a.isnan())
        return [p for p in dict.fromkeys(self.labels)
                if bool(hit[[i for i, label in enumerate(self.labels) if label == p]].any(0).all())]

    def other_placements(self, actual: Tensor) -> list[str]:
        """The placements of 1/W outside the rule that explain every element of `actual` (a wrong declaration)."""
        a = actual.detach().to(self.reference.device)
        return [p for p, c in (self.others or {}).items() if bool(((c == a) | (c.isnan() & a.isnan())).any(0).all())]

    def spread(self) -> tuple[float, float]:
        """The widest element of the envelope: (absolute width, width in units of u·Σ|x_i|)."""
        widths = []
        if self.candidates is not None:
            c = self.candidates.double()
            widths.append((c.max(0).values - c.min(0).values).nan_to_num(0.0))
        if self.radius is not None:
            widths.append((2 * self.radius).nan_to_num(0.0, posinf=0.0))
        if not widths or self.reference.numel() == 0:
            return 0.0, 0.0
        w = torch.stack(widths).max(0).values
        scale = (self.unit * self.magnitude).clamp_min(torch.finfo(torch.float64).tiny)
        relative = torch.where(self.magnitude > 0, w / scale, torch.zeros_like(w))
        return float(w.max()), float(relative.max())


def reference(value):
    """The rank-order value of an expected entry (an Envelope's reference; a tensor or None as is)."""
    return value.reference if isinstance(value, Envelope) else value


def rule_of(scenario, semantics):
    """The rule cross-rank sums are judged by: the adapter's declared lossy rule, else the
    scenario's; with the adapter's declared placement of 1/W (`Semantics.scaling`) where no comm
    hook takes the averaging over."""
    communication = getattr(semantics, "communication", None)
    if communication is not None:  # simulated lossy communication (PowerSGD): its own rule
        return communication.rule()
    tol = getattr(semantics, "lossy", None) or scenario.tolerance
    divide = PLACEMENTS[getattr(getattr(semantics, "scaling", None), "value", "pre")]
    if divide != ("pre",) and tol.exact and not scenario.options.comm_hook:
        tol = replace(tol, divide=divide)
    return tol


# `Semantics.scaling` -> the placements of 1/W the envelope accepts ("pre-or-post": undeclared,
# the `--ddp-class` default: either exact average passes, and the report says which one matched).
PLACEMENTS = {"pre": ("pre",), "post": ("post",), "pre-or-post": ("pre", "post")}
EXACT_PLACEMENTS = ("pre", "post")


def ulp(t: Tensor) -> Tensor:
    """The spacing of `t`'s dtype at each element's magnitude, float64 (never 0; 1 for integers and bools)."""
    if not t.is_floating_point():
        return torch.ones(t.shape, dtype=torch.float64, device=t.device)
    a = t.detach().abs()
    up = torch.nextafter(a, torch.full_like(a, math.inf))
    return (up.double() - a.double()).clamp_min(torch.finfo(t.dtype).tiny)


def _variants(grads: list[Tensor], divisor: int, where: str) -> list[tuple[list[Tensor], tuple[str, float] | None]]:
    """(shares as the ranks send them, what divides the sum afterwards) for one placement of 1/W.

    "pre" has two forms in torch itself: the DDP reducer multiplies each gradient by fl(1/W)
    while copying it into the bucket (reducer.cpp, `mul_out` with `1. / div_factor_`), its
    allreduce comm hook divides the bucket by W (`div_`). They differ in the last bit unless W
    is a power of two. "split" is FSDP's pre-divide factor, then the rest after the sum.
    """
    if where == "pre":
        out = [([g / divisor for g in grads], None)]
        if divisor & (divisor - 1):  # not a power of two: the reciprocal rounds
            out.append(([g * (1.0 / divisor) for g in grads], None))
        return out
    if where == "split":
        pre = fsdp_predivide(divisor)
        post = divisor / pre
        return [([g / pre for g in grads], None if post == 1 else ("div", post))]
    out = [(list(grads), ("div", float(divisor)))]  # "post": sum, then divide by W or multiply by fl(1/W)
    if divisor & (divisor - 1):
        out.append((list(grads), ("mul", 1.0 / divisor)))
    return out


def reduce(grads: list[Tensor | None], divisor: int, tol) -> Tensor | Envelope | None:
    """(1/divisor)·Σ grads as the engine may compute it, under the rule `tol` (a `Tolerance`).

    None entries (a rank that did not use the parameter contributes zeros) are left out: adding
    an exact zero never changes a sum. A plain tensor comes back wherever the result is
    order-free (one or two terms, or every order agreeing): it is then judged bitwise.
    """
    grads = [g for g in grads if g is not None]
    if not grads:
        return None
    shares = [g / divisor for g in grads]
    reference = sequential(shares)
    rule = tol.kind
    if rule in ("band", "norm"):
        return reference
    if rule == "derived-bound":
        return _bound(grads, reference, divisor, tol)
    n = len(grads)
    # The rank-order sum of divided shares is a "pre" candidate: a rule without "pre" leaves it out.
    sums, labels = ([reference], ["pre"]) if "pre" in tol.divide else ([], [])
    for where in tol.divide:
        found = _orders(grads, divisor, where)
        sums.extend(found)
        labels.extend([where] * len(found))
    candidates = torch.stack(sums)
    first = candidates[0]
    if n <= MAX_ENUMERATED and bool(((candidates == first) | (candidates.isnan() & first.isnan())).all()):
        return first  # every order agrees: bitwise
    places = "/".join(tol.divide)
    if n <= MAX_ENUMERATED:
        trees = len(summation_trees(list(range(n))))
        formula = f"bitwise to one of the {trees} summation trees of {n} shares (1/W: {places}; {len(sums) - ('pre' in tol.divide)} candidates)"
        others = {p: torch.stack(_orders(grads, divisor, p)) for p in EXACT_PLACEMENTS if p not in tol.divide}
        return Envelope(reference, "summation-order", formula, candidates=candidates,
                        magnitude=sequential([g.double().abs() / divisor for g in grads]),
                        unit=UNIT_ROUNDOFF[dtype_name(reference.dtype)], labels=tuple(labels), others=others)
    env = _bound(grads, reference, divisor, tol)
    env.rule, env.candidates, env.labels = "summation-order", candidates, tuple(labels)
    env.formula = f"bitwise to a ring order of {n} shares, or {env.formula}"
    return env


def _orders(grads: list[Tensor], divisor: int, where: str) -> list[Tensor]:
    """Every summation order's result with 1/W placed `where` (every tree up to 4 terms, ring orders beyond)."""
    out = []
    for terms, after in _variants(grads, divisor, where):
        found = summation_trees(terms) if len(terms) <= MAX_ENUMERATED else ring_orders(terms)
        if after is not None:
            found = [t / after[1] if after[0] == "div" else t * after[1] for t in found]
        out.extend(found)
    return out


def _bound(grads, reference, divisor, tol) -> Envelope:
    """|ŝ - s| <= γ_m·Σ|x_i| + m·n·η around the exact sum s of the exact shares."""
    n = len(grads)
    sum_dtype = tol.sum_dtype or dtype_name(reference.dtype)
    u, eta = UNIT_ROUNDOFF[sum_dtype], UNDERFLOW[sum_dtype]
    # The exact quotients g_i/W, each with its roundings before the sum: the declared casts, the
    # scaling by 1/W (none for a power of two; two for a multiplication by a rounded fl(1/W)),
    # and one more where the division may come after the sum.
    exact = [g.double() / divisor for g in grads]
    scaling = 0 if divisor & (divisor - 1) == 0 else 2
    m = tol.roundings + scaling + (n - 1) + (0 if tuple(tol.divide) == ("pre",) else 1)
    center = sequential(exact)
    magnitude = sequential([x.abs() for x in exact])
    slack = 4 * n * 2.0**-53  # the float64 centre's own rounding
    # A division by a power of two is exact (no γ term) unless its quotient underflows into the
    # subnormals: one more η per share (join: a single active share of 2**-24 in fp16, halved, is 0).
    m_eta = m + (1 if divisor > 1 and scaling == 0 else 0)
    radius = (gamma(m, u) + slack) * magnitude + m_eta * n * eta
    formula = (f"|ŝ-s| <= γ_{m}·Σ|x_i| + {m_eta}·{n}·η, γ_{m} = {m}u/(1-{m}u), u = 2^{int(math.log2(u))} "
               f"({sum_dtype})")
    return Envelope(reference, "derived-bound", formula, center=center, radius=radius, magnitude=magnitude, unit=u)


# -- HSDP's reduce-scatter-only accumulation: a three-level summation tree ------------------------
# [Note: the HSDP accumulation tree]
# With FSDP2's `set_requires_all_reduce(False)` on a (R replicas, S shards) mesh each micro-batch
# is reduce-scattered inside its shard group and the reduced chunk accumulated there; only the
# last (synced) micro-batch all-reduces the accumulated chunk across the R replicas. For rank
# (r, s) and micro-batch m with local gradient g_{r,s,m} the engine computes
#
#     D2( Σ^tree_r  A_r ),   A_r = (((B_{r,1} + B_{r,2}) + ...) + B_{r,M}),   B_{r,m} = D1( Σ^tree_s D0(g_{r,s,m}) )
#
# (FSDP2: `partial_reduce_output += reduce_output`, then `reduce_output += partial` before the
# all-reduce: micro-batch order; addition is commutative bitwise, so the order inside each add
# does not matter). D0, D1, D2 are where the 1/W = 1/(R·S) is applied: "pre" D0 = /W (or ·fl(1/W));
# "post" either D2 = /W after everything, or /S after each reduce-scatter and /R after the
# all-reduce (FSDP2's ReduceOp.AVG on each collective for fp32/bf16); "split" FSDP's pre-divide
# factor p in D0 and W/p in D2 (FSDP2's fp16 path). Local accumulation (`no_sync()` proper) sums
# each rank's micro-batches first, a different tree: its 15 trees over 4 rank totals need not
# contain this one, so the oracle models it here instead of widening the rule.
#
# Enumerated (bitwise to one of the candidates) while there are at most MAX_STAGED candidate
# values per placement: every tree over S shares per micro-batch, every tree over R replica
# sums. Beyond that the derived bound of a summation tree (Higham §4.2: ŝ = Σ x_i·Π(1+δ) over the
# roundings on x_i's path to the root): |ŝ - s| <= γ_h·Σ|x_i| + h·n·η with h the longest path:
# (S-1) + (M-1) + (R-1) additions, up to 2 roundings for each of the three divisions whose
# divisor is not a power of two (a rounded reciprocal times the value), and the declared casts.
MAX_STAGED = 256


def _stage_divisors(W: int, S: int, R: int, divide: tuple[str, ...]) -> list[tuple[tuple, tuple, tuple]]:
    """(D0, D1, D2) per placement of 1/W, each ("div", d) / ("mul", fl(1/d)) / None."""
    def forms(d):
        if d == 1:
            return [None]
        return [("div", float(d))] + ([("mul", 1.0 / d)] if d & (d - 1) else [])

    out = []
    for where in divide:
        if where == "pre":
            out += [(f, None, None) for f in forms(W)]
        elif where == "post":
            out += [(None, None, f) for f in forms(W)]
            out += [(None, a, b) for a in forms(S) for b in forms(R)]  # AVG on each collective
        elif where == "split":
            p = fsdp_predivide(W)
            out += [(f, None, g) for f in forms(int(p)) for g in forms(int(W // p))]
    return out


def _apply(t: Tensor, f) -> Tensor:
    if f is None:
        return t
    return t / f[1] if f[0] == "div" else t * f[1]


def staged_reduce(grads: list[list[Tensor | None]], replicas: int, tol) -> Tensor | Envelope | None:
    """(1/W)·Σ over HSDP's reduce-scatter-only accumulation ([Note: the HSDP accumulation tree]).

    `grads[rank][m]`: rank's gradient of micro-batch m (None: unused there), ranks in global
    order r·S + s on a (replicas, S) mesh. A plain tensor where every candidate agrees.
    """
    W, R = len(grads), replicas
    S, M = W // R, len(grads[0])
    if not any(g is not None for row in grads for g in row):
        return None
    mesh = [[[grads[r * S + s][m] for s in range(S)] for m in range(M)] for r in range(R)]

    def present(ts):
        return [t for t in ts if t is not None]

    def seq_micro(values):  # accumulate micro-batch sums in order, skipping micro-batches without any
        values = [v for v in values if v is not None]
        return sequential(values) if values else None

    # Reference: the rank-order tree with pre-divided shares (what straight-through compares with).
    reps = [seq_micro([None if not present(mesh[r][m]) else sequential([g / W for g in present(mesh[r][m])])
                       for m in range(M)]) for r in range(R)]
    reference = sequential([x for x in reps if x is not None])
    if tol.kind in ("band", "norm"):
        return reference
    leaves = present([g for row in grads for g in row])
    if tol.kind == "derived-bound":
        return _staged_bound(leaves, reference, W, S, R, M, tol)
    trees = {1: 1, 2: 1, 3: 3, 4: 15}  # distinct summation trees of n terms (see summation_trees)
    if S > MAX_ENUMERATED or R > MAX_ENUMERATED or trees[S] ** (R * M) * trees[R] > MAX_STAGED:
        env = _staged_bound(leaves, reference, W, S, R, M, tol)
        env.rule = "summation-order"
        return env
    sums = []
    for d0, d1, d2 in _stage_divisors(W, S, R, tuple(tol.divide)):
        reps = []
        for r in range(R):
            options = [[None] if not present(mesh[r][m]) else
                       [_apply(t, d1) for t in summation_trees([_apply(g, d0) for g in present(mesh[r][m])])]
                       for m in range(M)]
            combos = [[]]
            for opts in options:
                combos = [c + [o] for c in combos for o in opts]
            reps.append([v for v in (seq_micro(c) for c in combos) if v is not None])
        reps = [x for x in reps if x]
        choices = [[]]
        for opts in reps:
            choices = [c + [o] for c in choices for o in opts]
        for c in choices:
            sums.extend(_apply(t, d2) for t in summation_trees(c))
    candidates = torch.stack([reference, *sums])
    if bool(((candidates == reference) | (candidates.isnan() & reference.isnan())).all()):
        return reference
    formula = (f"bitwise to one of {len(sums)} values of HSDP's reduce-scatter-only tree ({R} replicas x {S} shards, "
               f"{M} micro-batches: every tree per shard group and across replicas; 1/W: {'/'.join(tol.divide)})")
    return Envelope(reference, "summation-order", formula, candidates=candidates,
                    magnitude=sequential([g.double().abs() / W for g in leaves]),
                    unit=UNIT_ROUNDOFF[dtype_name(reference.dtype)])


def _staged_bound(leaves, reference, W, S, R, M, tol) -> Envelope:
    """The tree's derived bound ([Note: the HSDP accumulation tree]) around the exact sum."""
    n = len(leaves)
    sum_dtype = tol.sum_dtype or dtype_name(reference.dtype)
    u, eta = UNIT_ROUNDOFF[sum_dtype], UNDERFLOW[sum_dtype]
    divisions = sum(2 for d in (W, S, R) if d & (d - 1))
    h = tol.roundings + divisions + (S - 1) + (M - 1) + (R - 1)
    exact = [g.double() / W for g in leaves]
    center, magnitude = sequential(exact), sequential([x.abs() for x in exact])
    radius = (gamma(h, u) + 4 * n * 2.0**-53) * magnitude + h * n * eta
    formula = (f"|ŝ-s| <= γ_{h}·Σ|x_i| + {h}·{n}·η (HSDP tree: {S - 1}+{M - 1}+{R - 1} additions on a path, "
               f"{divisions} division roundings, {tol.roundings} casts), u = 2^{int(math.log2(u))} ({sum_dtype})")
    return Envelope(reference, "derived-bound", formula, center=center, radius=radius, magnitude=magnitude, unit=u)
