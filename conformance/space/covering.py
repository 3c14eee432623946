"""Covering arrays: few rows in which every allowed t-tuple of dimension values appears.

Why: bugs that need two features at once (clipping on an HSDP mesh, an fp16 hook on large
values) hide in a catalogue that turns one feature on at a time. A covering array of
strength 2 puts every allowed *pair* of values of any two dimensions into some row; strength
3 every triple. The number of rows grows with the square (cube) of the largest dimension and
only with the logarithm of the number of dimensions, so a whole area fits a small profile.

Constraints are named predicates with a reason. Each one names the dimensions it reads and is
evaluated once all of them are assigned (so it is well defined on a partial row); a tuple is
*allowed* when some complete row holding it satisfies every constraint, and otherwise
*excluded*, with the constraints that exclude it (`excluded`), which the coverage report lists.

The generator is a deterministic greedy (AETG-like, one candidate per row): a row starts from
the first uncovered tuple, then each other dimension takes the value that covers most uncovered
tuples with the values already chosen, among values that still leave the row completable (a
backtracking search). Ties go to the earlier value, so rows never depend on hash seeds or
set order. Usage::

    dims = (Dimension("precision", ("fp32", "bf16")), Dimension("hook", ("none", "fp16")))
    no_fp16_hook_on_bf16 = Constraint("hook-dtype", "the fp16 hook casts fp32 shares",
                                      ("precision", "hook"),
                                      lambda a: not (a["precision"] == "bf16" and a["hook"] == "fp16"))
    space = Space(dims, (no_fp16_hook_on_bf16,))
    rows = generate(space, strength=2)      # three rows: (fp32, none), (fp32, fp16), (bf16, none)
    assert uncovered(space, rows, 2) == []
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]
CANDIDATES = 8  # greedy rows tried per row kept (more: fewer rows, slower generation)
# A tuple of (dimension index, value index) pairs, dimension indices increasing.
Tuple = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Dimension:
    """A named axis of the scenario space; `values` in order (the first is the default)."""

    name: str
    values: tuple[Any, ...]
    doc: str = ""

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError(f"dimension {self.name}: no values")
        if len(set(map(repr, self.values))) != len(self.values):
            raise ValueError(f"dimension {self.name}: repeated values {self.values}")


@dataclass(frozen=True)
class Constraint:
    """`allows(assignment)` over the dimensions `reads` (all assigned when it is called)."""

    name: str
    reason: str
    reads: tuple[str, ...]
    allows: Callable[[Mapping[str, Any]], bool]


@dataclass(frozen=True)
class Space:
    dimensions: tuple[Dimension, ...]
    constraints: tuple[Constraint, ...] = ()

    def __post_init__(self) -> None:
        names = [d.name for d in self.dimensions]
        if len(set(names)) != len(names):
            raise ValueError(f"repeated dimension names: {names}")
        for c in self.constraints:
            unknown = set(c.reads) - set(names)
            if unknown:
                raise ValueError(f"constraint {c.name} reads unknown dimensions {sorted(unknown)}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dimensions)

    def dimension(self, name: str) -> Dimension:
        return self.dimensions[self.names.index(name)]


class _Solver:
    """Index-level view of a space: constraint checks on partial rows and completion."""

    def __init__(self, space: Space) -> None:
        self.space = space
        self.sizes = [len(d.values) for d in space.dimensions]
        index = {n: i for i, n in enumerate(space.names)}
        self.reads = [tuple(index[n] for n in c.reads) for c in space.constraints]
        # The constraints that become checkable when dimension i is assigned.
        self.by_dim: list[list[int]] = [[] for _ in self.sizes]
        for k, dims in enumerate(self.reads):
            for i in dims:
                self.by_dim[i].append(k)
        # neighbours[i]: bit mask of the dimensions sharing a constraint with dimension i.
        self.neighbours = [0] * len(self.sizes)
        for dims in self.reads:
            mask = sum(1 << i for i in dims)
            for i in dims:
                self.neighbours[i] |= mask
        self._memo: dict[tuple, bool] = {}
        self._feasible_memo: dict[tuple, bool] = {}
        self._rest_memo: dict[tuple, bool] = {}

    def _named(self, row: Sequence[int | None], dims: Iterable[int]) -> dict[str, Any]:
        return {self.space.dimensions[i].name: self.space.dimensions[i].values[row[i]] for i in dims}

    def broken(self, row: Sequence[int | None], just: int | None = None) -> list[int]:
        """Constraints (indices) fully assigned in `row` that it violates (only those reading `just`)."""
        out = []
        ks = self.by_dim[just] if just is not None else range(len(self.reads))
        for k in ks:
            dims = self.reads[k]
            if all(row[i] is not None for i in dims) and not self.space.constraints[k].allows(self._named(row, dims)):
                out.append(k)
        return out

    def _feasible(self, k: int, row: Sequence[int | None]) -> bool:
        """Whether constraint k holds for some values of its still unassigned dimensions (memoized):
        checking this as each dimension is assigned prunes the completion search early."""
        dims = self.reads[k]
        key = (k, tuple(row[i] for i in dims))
        hit = self._feasible_memo.get(key)
        if hit is None:
            choices = [range(self.sizes[i]) if row[i] is None else (row[i],) for i in dims]
            allows = self.space.constraints[k].allows
            names = [self.space.dimensions[i] for i in dims]
            hit = any(allows({d.name: d.values[v] for d, v in zip(names, values, strict=True)})
                      for values in itertools.product(*choices))
            self._feasible_memo[key] = hit
        return hit

    def consistent(self, row: Sequence[int | None], just: int | None = None) -> bool:
        ks = self.by_dim[just] if just is not None else range(len(self.reads))
        return all(self._feasible(k, row) for k in ks)

    def completable(self, row: list[int | None]) -> bool:
        """Whether the partial `row` extends to a complete row breaking no constraint."""
        if not self.consistent(row):
            return False
        key = tuple(row)
        if key not in self._memo:
            self._memo[key] = self._extends(list(row), 0)
        return self._memo[key]

    def _extends(self, row: list[int | None], start: int) -> bool:
        """Whether the unassigned dimensions from `start` on take values breaking no constraint.

        Every constraint whose dimensions are all assigned has been checked on the way here, so
        the answer depends only on the dimensions from `start` on and on the assigned values the
        constraints reading a free dimension see: that is the memo's key. Without it, proving a
        tuple excluded re-searched every unrelated earlier dimension (the strength-3 DDP array
        took more than 20 minutes)."""
        free = next((i for i in range(start, len(row)) if row[i] is None), None)
        if free is None:
            return True
        seen = 0
        for j in range(free, len(row)):
            if row[j] is None:
                seen |= self.neighbours[j]
        key = (free, tuple(row[free:]), tuple(row[k] for k in range(free) if seen >> k & 1))
        hit = self._rest_memo.get(key)
        if hit is None:
            hit = False
            for v in range(self.sizes[free]):
                row[free] = v
                if self.consistent(row, free) and self._extends(row, free + 1):
                    hit = True
                    break
            row[free] = None
            self._rest_memo[key] = hit
        return hit

    def tuples(self, strength: int) -> Iterable[Tuple]:
        for dims in itertools.combinations(range(len(self.sizes)), strength):
            for values in itertools.product(*(range(self.sizes[i]) for i in dims)):
                yield tuple(zip(dims, values, strict=True))

    def partial(self, t: Tuple) -> list[int | None]:
        row: list[int | None] = [None] * len(self.sizes)
        for i, v in t:
            row[i] = v
        return row

    def to_row(self, row: Sequence[int]) -> Row:
        return {d.name: d.values[v] for d, v in zip(self.space.dimensions, row, strict=True)}

    def from_row(self, row: Mapping[str, Any]) -> list[int]:
        out = []
        for d in self.space.dimensions:
            reprs = [repr(v) for v in d.values]
            if repr(row[d.name]) not in reprs:
                raise ValueError(f"row value {d.name}={row[d.name]!r} is not one of {d.values}")
            out.append(reprs.index(repr(row[d.name])))
        return out


def allowed_tuples(space: Space, strength: int) -> list[Tuple]:
    """Every t-tuple that some complete, constraint-respecting row holds, in a fixed order."""
    solver = _Solver(space)
    return [t for t in solver.tuples(strength) if solver.completable(solver.partial(t))]


def _covered_by(row: Sequence[int], strength: int) -> Iterable[Tuple]:
    return itertools.combinations(enumerate(row), strength)


def generate(space: Space, strength: int = 2, pinned: Iterable[Mapping[str, Any]] = ()) -> list[Row]:
    """Rows (dimension name -> value) covering every allowed `strength`-tuple.

    `pinned` rows (hand-written scenarios projected onto the space) count as covering first;
    the result holds only the new rows.
    """
    if not 1 <= strength <= len(space.dimensions):
        raise ValueError(f"strength {strength}: between 1 and the {len(space.dimensions)} dimensions")
    solver = _Solver(space)
    todo = dict.fromkeys(t for t in solver.tuples(strength) if solver.completable(solver.partial(t)))
    for row in pinned:
        for t in _covered_by(solver.from_row(row), strength):
            todo.pop(t, None)
    rows: list[Row] = []
    while todo:
        row = _best_row(solver, next(iter(todo)), todo, strength)
        for t in _covered_by(row, strength):
            todo.pop(t, None)
        rows.append(solver.to_row(row))
    return rows


def _best_row(solver: _Solver, seed: Tuple, todo: Mapping[Tuple, None], strength: int) -> list[int]:
    """The best of `CANDIDATES` greedy rows, each filling the free dimensions in another order
    (the natural order first, then fixed shuffles: `random.Random(k)` does not read the hash seed)."""
    free = [i for i in range(len(solver.sizes)) if i not in dict(seed)]
    best, best_new = None, -1
    for k in range(CANDIDATES):
        order = list(free)
        if k:
            random.Random(k).shuffle(order)
        row = _greedy_row(solver, seed, order, todo, strength)
        new = sum(t in todo for t in _covered_by(row, strength))
        if new > best_new:
            best, best_new = row, new
    return best  # type: ignore[return-value]


def _greedy_row(solver: _Solver, seed: Tuple, order: Sequence[int], todo: Mapping[Tuple, None],
                strength: int) -> list[int]:
    row = solver.partial(seed)
    for i in order:
        if row[i] is not None:
            continue
        best, best_gain = None, -1
        for v in range(solver.sizes[i]):
            row[i] = v
            if not solver.completable(row):
                continue
            gain = _gain(row, i, todo, strength)
            if gain > best_gain:
                best, best_gain = v, gain
        if best is None:  # the seed is allowed, so the row was completable before this dimension
            raise AssertionError(f"covering: no value of {solver.space.dimensions[i].name} completes the row")
        row[i] = best
    return row  # type: ignore[return-value]


def _gain(row: Sequence[int | None], i: int, todo: Mapping[Tuple, None], strength: int) -> int:
    """Uncovered tuples that row's value at `i` completes with values already chosen."""
    assigned = [(j, v) for j, v in enumerate(row) if v is not None and j != i]
    gain = 0
    for others in itertools.combinations(assigned, strength - 1):
        t = tuple(sorted((*others, (i, row[i]))))
        gain += t in todo
    return gain


def uncovered(space: Space, rows: Iterable[Mapping[str, Any]], strength: int = 2) -> list[Row]:
    """Allowed tuples that no row holds (each as a partial row), in a fixed order; [] when covered."""
    solver = _Solver(space)
    seen = {t for row in rows for t in _covered_by(solver.from_row(row), strength)}
    return [_named(solver, t) for t in allowed_tuples(space, strength) if t not in seen]


def violations(space: Space, rows: Iterable[Mapping[str, Any]]) -> list[tuple[int, str]]:
    """(row index, constraint name) for every constraint a row breaks."""
    solver = _Solver(space)
    return [(n, space.constraints[k].name) for n, row in enumerate(rows)
            for k in solver.broken(solver.from_row(row))]


def excluded(space: Space, strength: int = 2) -> list[tuple[Row, tuple[str, ...]]]:
    """Tuples no allowed row can hold, each with the names of the constraints that rule it out.

    A tuple broken by a constraint reading only its own dimensions names that constraint; one
    excluded only through a chain (every completion breaks something) names those it hits.
    """
    solver = _Solver(space)
    out = []
    for t in solver.tuples(strength):
        row = solver.partial(t)
        if solver.completable(row):
            continue
        direct = solver.broken(row)
        names = direct or _chain(solver, row)
        out.append((_named(solver, t), tuple(space.constraints[k].name for k in names)))
    return out


def _chain(solver: _Solver, row: list[int | None]) -> list[int]:
    """The constraints a tuple excluded through a chain meets: those every tried completion
    breaks (else all that any breaks), so the report names the ones that matter."""
    broken = [set(solver.broken(v)) for v in _completions(solver, row)]
    common = set.intersection(*broken) if broken else set()
    return sorted(common or set().union(*broken))


def _completions(solver: _Solver, row: list[int | None]) -> Iterable[list[int]]:
    """A few full completions (the first value of every free dimension, then each alone)."""
    free = [i for i, v in enumerate(row) if v is None]
    base = [v if v is not None else 0 for v in row]
    yield base
    for i in free:
        for v in range(1, solver.sizes[i]):
            yield [*base[:i], v, *base[i + 1:]]


def _named(solver: _Solver, t: Tuple) -> Row:
    return {solver.space.dimensions[i].name: solver.space.dimensions[i].values[v] for i, v in t}


def count(space: Space, strength: int = 2) -> tuple[int, int]:
    """(allowed, excluded) tuple counts."""
    solver = _Solver(space)
    total = sum(1 for _ in solver.tuples(strength))
    allowed = len(allowed_tuples(space, strength))
    return allowed, total - allowed
