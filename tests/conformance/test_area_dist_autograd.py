"""The dist_autograd area: catalogue shape, the local oracle, refimpl and torch on warm RPC pools,
and a known-bad implementation (one send's gradients lost) caught with a useful message."""


import pytest

from conformance import catalogue
from conformance.judge.compare import ConformanceError
from conformance.oracle import dist_autograd as dist_autograd_oracle
from conformance.pipeline import check
from tests.conformance.area_cases import scenario as _get

MUTANT = "conformance.adapters.dist_autograd:mutant_loses_second_send"



def test_catalogue_covers_the_issue():
    full = catalogue.select(area="dist_autograd", profile="full")
    kinds = {s.model for s in full}
    assert {"simple", "chain", "fan-out", "sent-twice", "round-trip", "multi-roots", "unused-arg",
            "unused-leaf", "unused-result", "retain-graph", "remote-error"} <= kinds
    assert {s.world_size for s in full} == {2, 3, 4}  # 4: the generated full's chains and fan-outs (issue 38)
    assert {s.world_size for s in full if s.model != "composed"} == {2, 3}
    quick = {s.id for s in catalogue.select(area="dist_autograd", profile="quick")}
    assert quick < {s.id for s in catalogue.select(area="dist_autograd", profile="standard")}


def test_oracle_is_local_autograd():
    grads = dist_autograd_oracle.oracle(_get("dist_autograd/simple/w2/fp64"), "simple")
    assert set(grads) == {"x@worker0", "w@worker0"}
    from conformance.models.dist_autograd import leaves

    L = leaves(0)
    assert grads["x@worker0"].equal(L["w"].detach()) and grads["w@worker0"].equal(L["x"].detach())
    unused = dist_autograd_oracle.oracle(_get("dist_autograd/unused-arg/w2/fp64"), "unused-arg")
    assert unused["w@worker0"] is None and unused["x@worker0"].eq(3).all()


@pytest.mark.slow
@pytest.mark.parametrize("scenario", catalogue.select(area="dist_autograd", profile="standard"), ids=str)
def test_refimpl_conforms(session, scenario):
    assert check(scenario, "refimpl-dist-autograd", session).comparisons >= 3


@pytest.mark.slow
def test_torch_error_message_is_normalised(session):
    checked = check(_get("dist_autograd/remote-error/w3/fp64"), "torch-dist-autograd", session)
    assert "Error on Node 2: Simulate error on backward pass" in checked.accepted_error


@pytest.mark.slow
def test_lost_send_is_caught(session):
    with pytest.raises(ConformanceError) as info:
        check(_get("dist_autograd/sent-twice/w3/fp64"), MUTANT, session)
    message = str(info.value)
    assert "dist_autograd/sent-twice/w3/fp64" in message and "backward pass 1" in message
    assert "x@worker0" in message and "differ" in message and "repro: gradparity run" in message
    # the pool is still healthy afterwards
    assert check(_get("dist_autograd/simple/w2/fp64"), "refimpl-dist-autograd", session).comparisons


# -- issue 16: the failure classes torch's own dist_autograd tests found -------------------------
ISSUE16 = {s.model: s for s in catalogue.all_scenarios() if s.area == "dist_autograd"
           and s.model in ("rref-to-here", "sparse", "torchscript", "tensor-free", "shared-grad",
                           "accumulate-hooks")}
# scenario kind -> (known-bad implementation, text its failure must show)
ISSUE16_MUTANTS = {
    "rref-to-here": ("mutant_rref_detached", "x@worker0"),
    "sparse": ("mutant_dense_sparse_grads", "gradient layout differs"),
    "torchscript": ("mutant_pickles_script_target", "cannot be pickled"),
    "tensor-free": ("mutant_forgets_tensor_free", "still hold contexts"),
    "shared-grad": ("mutant_shares_buffers", "share one gradient buffer"),
    "accumulate-hooks": ("mutant_skips_accumulate_hooks", "post hook on x's AccumulateGrad"),
}


def test_issue16_scenarios_each_have_a_known_bad_implementation():
    assert set(ISSUE16) == set(ISSUE16_MUTANTS)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(ISSUE16))
def test_torch_passes_issue16_scenarios(session, kind):
    assert check(ISSUE16[kind], "torch-dist-autograd", session).comparisons >= 3


# tensor-free last: its known-bad implementation leaks a context for good on worker2 of the
# module's w3 pool, so any later w3 case on that pool would fail the cleanup check.
@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(ISSUE16, key=lambda k: (k == "tensor-free", k)))
def test_issue16_known_bad_is_caught(session, kind):
    mutant, expected = ISSUE16_MUTANTS[kind]
    with pytest.raises(ConformanceError) as info:
        check(ISSUE16[kind], f"conformance.adapters.dist_autograd:{mutant}", session)
    assert expected in str(info.value), str(info.value)[:2000]


@pytest.mark.slow
def test_torch_keeps_contexts_of_two_workers_apart(session):
    """A18: torch's own engine passes contexts-meet (ids 2^48 apart: never levelled)."""
    assert check(_get("dist_autograd/contexts-meet/w3/fp64"), "torch-dist-autograd", session).comparisons >= 7
