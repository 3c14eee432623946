"""`gradparity list --coverage`'s numbers: pairs an engine cannot run are uncovered, with the reason."""

from conformance import coverage
from conformance.space import coverage as space_coverage


def test_an_engine_lacking_a_capability_has_uncovered_pairs_with_the_reason():
    (full,) = coverage.per_adapter("standard", ("refimpl-ddp",))
    assert full["covered"] == full["possible"] and not full["uncovered"]
    assert full["excluded"] > 0

    from conformance.catalogue import select

    scenarios = select(area="ddp", profile="standard")
    lacking = space_coverage.pairs("ddp", "standard", scenarios,
                                   lambda s: "lacks capability: broadcast_buffers" if not s.options.broadcast_buffers else "")
    assert lacking.covered < lacking.possible
    whys = {why for pair, why in lacking.uncovered}
    assert whys == {"lacks capability: broadcast_buffers"}
    assert all(pair.get("broadcast_buffers", False) is False for pair, _ in lacking.uncovered)


def test_exclusions_name_their_constraints():
    found = coverage.exclusions("ddp")
    assert found and all(e["constraints"] and e["why"] for e in found)
    assert any(e["pair"] == {"hook": "fp16", "reduce_dtype": "bf16"} for e in found)
