"""Tolerance policy and self-explanatory mismatch messages.

A failure message must let someone act without rerunning: it names the scenario, rank,
point in training, parameter, max abs/rel error, the worst index with expected and actual
values, the tolerance, and a repro command.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from conformance.oracle.envelope import Envelope, ulp
from conformance.spec import Tolerance


@dataclass
class Mismatch:
    name: str
    problem: str  # one line: what is wrong
    max_abs: float = float("nan")
    max_rel: float = float("nan")
    worst_index: tuple[int, ...] | None = None
    expected_value: float | None = None
    actual_value: float | None = None
    # How far outside the rule the worst element lies: absolute, and in ulps of the tensor's
    # dtype at the expected value (for a band: beyond rtol*|expected| + atol).
    outside: float | None = None
    outside_ulps: float | None = None
    # The next-worst failing elements: (index, expected, actual, outside, outside in ulps).
    others: list[tuple[tuple[int, ...], float, float, float, float]] | None = None

    # Failing elements whose expected value is 0: no relative error or ulp count means anything there.
    zero_expected: int = 0
    # Exact placements of 1/W outside the rule that explain every element (a wrong declaration).
    other_placements: tuple[str, ...] = ()

    def render(self) -> str:
        line = f"{self.name}: {self.problem}"
        if self.worst_index is not None:
            line += (
                f"; max abs err {self.max_abs:.3g}, max rel err {_relative(self.max_rel, self.zero_expected)}, "
                f"worst at index {list(self.worst_index)}: expected {self.expected_value!r}, actual {self.actual_value!r}"
            )
        if self.outside is not None:
            line += f"; {self.outside:.3g} outside the rule{_in_ulps(self.outside_ulps, self.expected_value)}"
        for index, e, a, out, ulps in self.others or ():
            line += f"; at {list(index)}: expected {e!r}, actual {a!r}, {out:.3g} outside{_in_ulps(ulps, e)}"
        return line


def _relative(value: float, zero_expected: int = 0) -> str:
    """A relative error for people, over the failing elements whose expected value is not 0 (a
    ratio to 0 means nothing, and an `inf` there hid the ratio of the element shown as worst)."""
    if value == float("inf") or (zero_expected and value == 0.0):
        return "n/a (every failing element expects 0)"
    return f"{value:.3g}" + (f" ({zero_expected} failing elements expect 0)" if zero_expected else "")


def _in_ulps(ulps: float | None, expected: float | None) -> str:
    """ " (N ulps)" of the dtype's spacing at the expected value; nothing where that is 0 (the
    spacing there is the smallest subnormal, which printed 4.25e+37 ulps for an error of 0.5)."""
    return "" if ulps is None or expected == 0.0 else f" ({ulps:.3g} ulps)"


def compare_tensor(name: str, expected: Tensor | None, actual: Tensor | None, tol: Tolerance) -> Mismatch | None:
    """None when `actual` is acceptable, otherwise what is wrong with it."""
    if expected is None and actual is None:
        return None
    if expected is None:
        if actual is not None and not actual.is_floating_point():
            return Mismatch(name, "expected None (no rank used this parameter) but a value is present")
        nonzero = int((actual != 0).sum())
        return Mismatch(
            name,
            f"expected grad None (no rank used this parameter) but got a tensor ({nonzero} non-zero of {actual.numel()})",
        )
    if actual is None:
        return Mismatch(name, "expected a gradient but got None (was the parameter reduced?)")
    if isinstance(expected, Envelope):
        if not tol.exact:  # a band (the last resort) or a norm bound: around the rank-order value
            return compare_tensor(name, expected.reference, actual, tol)
        return _compare_envelope(name, expected, actual)
    if actual.dtype != expected.dtype:
        return Mismatch(name, f"dtype {actual.dtype} but expected {expected.dtype}")
    if actual.shape != expected.shape:
        return Mismatch(name, f"shape {tuple(actual.shape)} but expected {tuple(expected.shape)}")
    e, a = expected.detach().to("cpu"), actual.detach().to("cpu")
    if not tol.exact and tol.norm_rtol is not None:
        return _compare_norm(name, e, a, tol)
    if tol.exact:
        if torch.equal(e, a) or (e.isnan() == a.isnan()).all() and torch.equal(e.nan_to_num(), a.nan_to_num()):
            return None
        bad = e != a
    else:
        ef, af = e.double(), a.double()
        bad = ~torch.isclose(af, ef, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
        if not bad.any():
            return None
    ef, af = e.double(), a.double()
    diff = (af - ef).abs()
    allowed = torch.zeros_like(diff) if tol.exact else tol.atol + tol.rtol * ef.abs()
    return _mismatch(name, f"{int(bad.sum())} of {e.numel()} elements differ ({tol.describe()})",
                     bad, ef, af, (diff - allowed).clamp_min(0.0), e)


def _mismatch(name: str, problem: str, bad: Tensor, ef: Tensor, af: Tensor, outside: Tensor, like: Tensor) -> Mismatch:
    """The worst failing element (the farthest outside the rule), with its expected and actual values."""
    diff = (af - ef).abs()
    # Relative to the expected value, over the elements where that is not 0; the others are
    # counted (`zero_expected`) and the message says so instead of dividing by the smallest float.
    rel = torch.where(ef != 0, diff / ef.abs().clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    zero_expected = int((bad & (ef == 0)).sum())
    masked = torch.where(bad, outside.nan_to_num(float("inf")), torch.full_like(outside, -1.0))
    flat = int(masked.flatten().argmax()) if masked.numel() else 0
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), like.shape)) if like.dim() else ()
    worst = float(outside.flatten()[flat]) if outside.numel() else 0.0
    spacings = ulp(ef.to(like.dtype) if like.is_floating_point() else like).flatten() if like.numel() \
        else torch.ones(1, dtype=torch.float64)
    spacing = float(spacings[flat])
    others = []
    if int(bad.sum()) > 1:  # the next worst, so a reader sees how far outside each failing element lies
        order = masked.flatten().argsort(descending=True)[1:OTHERS + 1]
        for i in (int(i) for i in order if bool(bad.flatten()[i])):
            at = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), like.shape)) if like.dim() else ()
            out = float(outside.flatten()[i])
            others.append((at, float(ef.flatten()[i]), float(af.flatten()[i]), out, out / float(spacings[i])))
    return Mismatch(
        name, problem,
        max_abs=float(torch.where(bad, diff, torch.zeros_like(diff)).max()) if diff.numel() else 0.0,
        max_rel=float(torch.where(bad, rel, torch.zeros_like(rel)).max()) if rel.numel() else 0.0,
        worst_index=index,
        expected_value=float(ef.flatten()[flat]) if ef.numel() else None,
        actual_value=float(af.flatten()[flat]) if af.numel() else None,
        outside=worst, outside_ulps=worst / spacing, others=others, zero_expected=zero_expected,
    )


OTHERS = 2  # failing elements shown besides the worst


def _compare_envelope(name: str, env: Envelope, actual: Tensor) -> Mismatch | None:
    """Per element: in the envelope (equal to a summation order's result, or within the derived bound)."""
    if actual.dtype != env.dtype:
        return Mismatch(name, f"dtype {actual.dtype} but expected {env.dtype}")
    if actual.shape != env.shape:
        return Mismatch(name, f"shape {tuple(actual.shape)} but expected {tuple(env.shape)}")
    a = actual.detach().to(env.reference.device)
    bad = ~env.accepts(a)
    if not bad.any():
        return None
    nearest, outside = env.nearest(a)
    others = tuple(env.other_placements(a))
    matches = f"; every element matches 1/W placed {'/'.join(others)}" if others else ""
    m = _mismatch(name, f"{int(bad.sum())} of {a.numel()} elements outside the envelope ({env.rule}: {env.formula}){matches}; "
                  "expected = the nearest accepted value", bad, nearest, a.double(), outside, a)
    m.other_placements = others
    return m


def placements_matched(expected: dict, actual: dict) -> set[str] | None:
    """The placements of 1/W that explain every labelled envelope of one accepted event (None: none labelled)."""
    found = None
    for name, env in expected.items():
        if isinstance(env, Envelope) and env.labels is not None and len(set(env.labels)) > 1 and actual.get(name) is not None:
            here = set(env.placements(actual[name]))
            found = here if found is None else found & here
    return found


def _compare_norm(name: str, e: Tensor, a: Tensor, tol: Tolerance) -> Mismatch | None:
    """The whole-tensor bound of a lossy implementation: relative L2 error (NaN never passes)."""
    ef, af = e.double(), a.double()
    err, ref = float((af - ef).norm()), float(ef.norm())
    bound = tol.norm_rtol * ref + tol.atol * max(1, e.numel()) ** 0.5
    if err <= bound:
        return None
    diff = (af - ef).abs().flatten()
    flat = int(diff.nan_to_num(float("inf")).argmax()) if diff.numel() else 0
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), e.shape)) if e.dim() else ()
    return Mismatch(
        name,
        f"||error|| = {err:.3g} exceeds the bound {bound:.3g} ({tol.describe()}; relative error {err / max(ref, 1e-300):.3g})",
        max_abs=float(diff.max()) if diff.numel() else 0.0, max_rel=err / max(ref, 1e-300), worst_index=index,
        expected_value=float(ef.flatten()[flat]) if e.numel() else None,
        actual_value=float(af.flatten()[flat]) if a.numel() else None,
    )


def compare_dicts(expected: dict, actual: dict, tol: Tolerance) -> list[Mismatch]:
    """Compare by name; a missing or unexpected name is a mismatch too."""
    out = []
    for name in expected:
        if name not in actual:
            out.append(Mismatch(name, "missing from the implementation's result"))
            continue
        m = compare_tensor(name, expected[name], actual[name], tol)
        if m:
            out.append(m)
    for name in actual:
        if name not in expected:
            out.append(Mismatch(name, "not a parameter of the model (unexpected name)"))
    return out


EXACT_ACROSS_RANKS = Tolerance(True, reason="ranks must be bitwise identical")


def first_divergence(where: str, name: str) -> str:
    """The line every wrong-value failure carries: the first (step, micro-batch, module, tensor) out
    of its rule. Mismatches come in the model's registration order, so the first named is the first
    tensor of the first event that left its rule (the HTML's divergence map shows the rest)."""
    module, _, tensor = name.rpartition(".")
    return f"first outside its rule: {where}, module {module or '(root)'}, tensor {tensor}"


class ConformanceError(AssertionError):
    """A contract violation; its message is the whole explanation."""


def failure_message(
    *, scenario_id: str, adapter: str, rank: int, where: str, what: str, mismatches: list[Mismatch],
    tol: Tolerance, repro: str, limit: int = 5,
) -> str:
    lines = [
        f"[{scenario_id}] adapter {adapter}: rank {rank}, {where}: {what}",
        f"  {first_divergence(where, mismatches[0].name)}" if mismatches else "",
        f"  tolerance: {tol.describe()} ({tol.reason})",
    ]
    lines = [line for line in lines if line]
    for m in mismatches[:limit]:
        lines.append(f"  - {m.render()}")
    if len(mismatches) > limit:
        names = ", ".join(m.name for m in mismatches[limit:limit + 10])
        lines.append(f"  ... and {len(mismatches) - limit} more: {names}")
    lines.append(f"  repro: {repro}")
    return "\n".join(lines)
