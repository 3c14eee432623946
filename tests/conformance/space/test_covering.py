"""The covering-array generator: every allowed tuple covered, constraints kept, rows deterministic."""

import itertools
import os
import random
import subprocess
import sys

import pytest

from conformance.space.covering import (
    Constraint,
    Dimension,
    Space,
    allowed_tuples,
    count,
    excluded,
    generate,
    uncovered,
    violations,
)


def _space(rng: random.Random, n_dims: int, with_constraints: bool) -> Space:
    dims = tuple(Dimension(f"d{i}", tuple(f"v{j}" for j in range(rng.randint(1, 4)))) for i in range(n_dims))
    constraints = []
    if with_constraints:
        for k in range(rng.randint(1, 4)):
            a, b = rng.sample(range(n_dims), 2)
            va, vb = rng.choice(dims[a].values), rng.choice(dims[b].values)
            na, nb = dims[a].name, dims[b].name
            constraints.append(Constraint(f"c{k}", f"not {na}={va} with {nb}={vb}", (na, nb),
                                          lambda x, na=na, nb=nb, va=va, vb=vb: not (x[na] == va and x[nb] == vb)))
    return Space(dims, tuple(constraints))


def _brute_allowed(space: Space, strength: int) -> set:
    """Allowed tuples by enumerating every complete row (small spaces only)."""
    names = space.names
    found = set()
    for values in itertools.product(*(d.values for d in space.dimensions)):
        row = dict(zip(names, values, strict=True))
        if all(c.allows({n: row[n] for n in c.reads}) for c in space.constraints):
            for dims in itertools.combinations(names, strength):
                found.add(tuple((n, row[n]) for n in dims))
    return found


@pytest.mark.parametrize("strength", [2, 3])
def test_every_allowed_tuple_is_covered_and_no_constraint_broken(strength):
    # A property test over 40 seeded random spaces (the same ones every run).
    rng = random.Random(38)
    for trial in range(40):
        space = _space(rng, rng.randint(3, 6), with_constraints=trial % 4 != 0)
        rows = generate(space, strength)
        assert violations(space, rows) == [], (trial, space)
        assert uncovered(space, rows, strength) == [], (trial, space)
        covered = {tuple((n, row[n]) for n in dims) for row in rows
                   for dims in itertools.combinations(space.names, strength)}
        assert _brute_allowed(space, strength) <= covered
        # allowed_tuples agrees with brute force
        assert len(allowed_tuples(space, strength)) == len(_brute_allowed(space, strength))


def test_pairwise_is_much_smaller_than_the_product():
    space = Space(tuple(Dimension(f"d{i}", (0, 1, 2)) for i in range(10)))
    rows = generate(space, 2)
    assert uncovered(space, rows) == []
    assert 9 <= len(rows) <= 20  # 3**10 = 59049 rows in the full product


def test_uncovered_lists_what_is_missing():
    space = Space((Dimension("a", (0, 1)), Dimension("b", ("x", "y"))))
    assert uncovered(space, [{"a": 0, "b": "x"}, {"a": 1, "b": "y"}]) == [{"a": 0, "b": "y"}, {"a": 1, "b": "x"}]


def test_constraints_exclude_pairs_and_say_why():
    no_fp16_hook_on_bf16 = Constraint("hook-dtype", "the fp16 hook casts fp32 shares", ("precision", "hook"),
                                      lambda a: not (a["precision"] == "bf16" and a["hook"] == "fp16"))
    space = Space((Dimension("precision", ("fp32", "bf16")), Dimension("hook", ("none", "fp16"))),
                  (no_fp16_hook_on_bf16,))
    rows = generate(space)
    assert {"precision": "bf16", "hook": "fp16"} not in rows
    assert len(rows) == 3
    assert excluded(space) == [({"precision": "bf16", "hook": "fp16"}, ("hook-dtype",))]
    assert count(space) == (3, 1)
    assert violations(space, [{"precision": "bf16", "hook": "fp16"}]) == [(0, "hook-dtype")]


def test_a_pair_excluded_only_through_a_chain_is_not_demanded():
    # a=1 forces c=1, b=1 forbids c=1: so (a=1, b=1) is in no valid row although no constraint reads both.
    space = Space((Dimension("a", (0, 1)), Dimension("b", (0, 1)), Dimension("c", (0, 1))), (
        Constraint("a-c", "a=1 needs c=1", ("a", "c"), lambda x: x["a"] == 0 or x["c"] == 1),
        Constraint("b-c", "b=1 forbids c=1", ("b", "c"), lambda x: x["b"] == 0 or x["c"] == 0),
    ))
    rows = generate(space)
    assert uncovered(space, rows) == [] and violations(space, rows) == []
    assert {"a": 1, "b": 1} in [row for row, _ in excluded(space)]


def test_pinned_rows_count_as_covering():
    space = Space((Dimension("a", (0, 1)), Dimension("b", (0, 1))))
    rows = generate(space, pinned=[{"a": 0, "b": 0}, {"a": 1, "b": 1}])
    assert sorted(map(sorted, (r.items() for r in rows))) == [[("a", 0), ("b", 1)], [("a", 1), ("b", 0)]]


def test_rows_do_not_depend_on_the_hash_seed():
    code = ("from tests.conformance.space.test_covering import _space; import random;"
            "from conformance.space.covering import generate;"
            "s = _space(random.Random(7), 6, True); print(generate(s, 2)); print(generate(s, 3))")
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
    assert len(outs) == 1


def test_bad_spaces_are_refused():
    with pytest.raises(ValueError, match="no values"):
        Dimension("a", ())
    with pytest.raises(ValueError, match="unknown dimensions"):
        Space((Dimension("a", (0,)),), (Constraint("c", "r", ("b",), lambda x: True),))
    with pytest.raises(ValueError, match="not one of"):
        uncovered(Space((Dimension("a", (0,)), Dimension("b", (0,)))), [{"a": 5, "b": 0}])
