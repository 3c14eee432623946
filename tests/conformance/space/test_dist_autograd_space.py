"""The dist_autograd space: a row reads back and its id says its values, the hand-written
compositions count as rows, the generated composition is the one its values say (checked here
in mode "local", the oracle's), and an engine that cannot run a value shows its pairs uncovered
with its reason."""

import pytest
import torch

from conformance.catalogue import dist_autograd as da_catalogue
from conformance.catalogue import select
from conformance.models import dist_autograd as fns
from conformance.models import dist_autograd_composed as composed
from conformance.oracle.dist_autograd import oracle
from conformance.space.dist_autograd_rows import DEFAULTS, project, scenario


@pytest.fixture(scope="module")
def standard():
    return select(area="dist_autograd", profile="standard")


def test_a_row_reads_back_and_its_id_says_its_values():
    row = dict(DEFAULTS, topology="chain", world=3, structure="nested", call="async", passes=3, dtype="fp32")
    s = scenario(row, frozenset({"standard", "full"}))
    assert project(s) == row
    assert s.id == "dist_autograd/pairs/chain/w3/fp32/structure-nested+call-async+passes-3"
    assert (s.model, s.world_size, s.dtype, s.kwargs()) == ("composed", 3, "float32", row)
    assert {"A5", "A9", "A10", "A11"} <= set(s.clauses)
    assert composed.passes_of(s, s.model) == 3 and composed.fail_node(s) is None
    assert composed.fail_node(scenario(dict(row, passes=1, error="remote"), frozenset())) == 2


def test_hand_written_scenarios_count_as_rows():
    pinned = {s.id: s for s in da_catalogue.handwritten()}
    assert project(pinned["dist_autograd/async/w3/fp64"]) == dict(DEFAULTS, topology="fan-out", world=3,
                                                                    call="async")
    assert project(pinned["dist_autograd/remote-error/w3/fp64"])["error"] == "remote"
    assert project(pinned["dist_autograd/unused-result/w2/fp64"])["unused"] == "result"  # full's value
    assert project(pinned["dist_autograd/sparse/w2/fp64"]) is None  # a composition of its own
    assert project(pinned["dist_autograd/retain-graph/w3/fp64"]) is None  # 4 passes: not a value


def _row(**values) -> dict:
    return dict(DEFAULTS, **values)


def test_the_local_replay_is_what_the_values_say():
    """Mode "local" (the oracle): an unused leaf and an ignored argument get no gradient, remote
    parameters one on their owners, fp32 rows fp32 gradients, several roots the gradient of their sum."""
    leaf = oracle(scenario(_row(unused="leaf"), frozenset()), "composed")
    assert leaf["u@worker0"] is None and leaf["x@worker0"] is not None
    arg = oracle(scenario(_row(unused="arg", structure="nested"), frozenset()), "composed")
    assert arg["u@worker0"] is None
    owners = oracle(scenario(_row(topology="chain", world=3, params="remote", dtype="fp32"), frozenset()), "composed")
    assert set(owners) == {"x@worker0", "w@worker0", "cfp32w1@worker1", "cfp32w2@worker2"}
    assert all(g.dtype == torch.float32 for g in owners.values())
    one = oracle(scenario(_row(topology="fan-out", world=3), frozenset()), "composed")
    several = oracle(scenario(_row(topology="fan-out", world=3, roots="several"), frozenset()), "composed")
    for name in one:
        torch.testing.assert_close(several[name], one[name], rtol=1e-12, atol=1e-12)


def test_a_failing_row_raises_in_the_local_backward_and_names_its_worker():
    s = scenario(_row(topology="fan-out", world=3, error="remote"), frozenset())
    leaves = composed.leaves_of(s, "composed", s.seed)
    roots = composed.composition_of(s, "composed")("local", s.seed, leaves)
    with pytest.raises(RuntimeError, match="Simulate error on backward pass"):
        torch.autograd.grad(roots, list(leaves.values()))
    assert composed.fail_node(s) == 2
    fns.reset_params("local")


def test_an_engine_without_rrefs_shows_those_pairs_uncovered_with_its_reason(standard):
    from conformance.adapters.dist_autograd import RefimplDistAutograd
    from conformance.plan import _capability_skip
    from conformance.space import coverage

    class NoRRefs(RefimplDistAutograd):
        name = "no-rrefs"

        def unavailable(self, s):
            row = project(s)
            return "no remote()/RRef in this engine" if row and row["call"] == "rref" else None

    engine = NoRRefs()
    limited = coverage.pairs("dist_autograd", "standard", standard, lambda s: _capability_skip(engine, s))
    uncovered = [pair for pair, _ in limited.uncovered]
    rref_pairs = [pair for pair, _ in coverage.pairs("dist_autograd", "standard", []).uncovered
                  if pair.get("call") == "rref"]  # every pair holding call=rref, none covered by no scenario
    assert rref_pairs and all(pair in uncovered for pair in rref_pairs)
    # a pair the array put only into rows with an RRef is uncovered too, with the same reason: never dropped
    assert all("no remote()/RRef in this engine" in why for _, why in limited.uncovered)
    assert limited.covered == limited.possible - len(limited.uncovered) > 0
    every = coverage.pairs("dist_autograd", "standard", standard,
                           lambda s: _capability_skip(RefimplDistAutograd(), s))
    assert every.covered == every.possible and every.excluded == 4
