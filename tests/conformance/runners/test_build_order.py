"""The orders a user's loop builds and resumes in (issue 38): the switches, and what they catch.

A correct engine trains the same in every order (torch DDP keeps the module's Parameter
objects); `ix-params-replaced-at-wrap` (parameters re-registered at construction) passes the
default order and fails the optimizer-first one, in the plain loop and in the production loop.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conformance import pipeline
from conformance.adapters.ddp_like import DDPLikeWrapped
from conformance.features import Features
from conformance.judge.compare import ConformanceError
from conformance.runners import build_order as orders
from conformance.runners import ddp_features
from conformance.space.ddp_rows import DEFAULTS, scenario

MUTANT = "conformance.mutants.independent.interactions_ddp:params_replaced_at_wrap"
CORRECT = "conformance.mutants.independent.interactions_ddp:correct"
PROFILES = frozenset({"standard", "full"})
CTX = SimpleNamespace(rank=0, device=torch.device("cpu"), group=None)


def _row(**values):
    return scenario(dict(DEFAULTS, **values), PROFILES)


def test_the_switches_travel_in_the_scenario_and_its_id():
    s = _row(build_order="optimizer-first", round_trip="once", resume_order="load-wrap")
    assert orders.build_order(s) == "optimizer-first"
    assert orders.resume_order(Features.of(s)) == "load-wrap"
    assert s.id.endswith("resume-once+build-optimizer-first+reload-load-wrap")
    assert orders.build_order(_row()) == "wrap-first" and orders.resume_order(Features.of(_row(round_trip="once"))) == "wrap-load"


def test_an_unknown_order_is_refused_in_one_line():
    s = _row().with_(model_kwargs=(("build_order", "optimiser-first"),))
    with pytest.raises(ValueError, match="build_order 'optimiser-first' is not one of wrap-first, optimizer-first"):
        orders.build_order(s)
    with pytest.raises(ValueError, match="resume_order 'late' is not one of"):
        orders.resume_order(Features(resume_order="late"))


def test_an_engine_that_owns_the_optimizer_builds_none_before_wrapping():
    s = _row(build_order="optimizer-first")
    assert orders.optimizer_first(s, frozenset())
    assert not orders.optimizer_first(s, frozenset({"optimizer"}))


def test_a_wrappers_state_dict_reads_as_the_bare_modules():
    state = {"module.a.weight": 1, "module._orig_mod.b.bias": 2, "c": 3}
    assert orders.module_state(state) == {"a.weight": 1, "b.bias": 2, "c": 3}
    assert list(orders.module_state(state)) == ["a.weight", "b.bias", "c"]


@pytest.mark.parametrize("loop", ["plain", "production"])
def test_parameters_replaced_at_wrap_fail_the_optimizer_first_order_only(session, loop):
    extra = {"clip": "above"} if loop == "production" else {}  # a feature: the production loop
    default, first = _row(**extra), _row(build_order="optimizer-first", **extra)
    assert bool(default.features) == (loop == "production")
    pipeline.check(default, MUTANT, session)  # the order the catalogue always used: the bug hides
    pipeline.check(first, CORRECT, session)
    with pytest.raises(ConformanceError, match="step 0"):
        pipeline.check(first, MUTANT, session)


@pytest.mark.parametrize("resume", orders.RESUME_ORDERS)
def test_a_correct_engine_resumes_in_every_order(session, resume):
    s = _row(build_order="optimizer-first", round_trip="once", resume_order=resume, optimizer="adam")
    pipeline.check(s, CORRECT, session)


class _Recording(torch.nn.Module):
    """A DDP stand-in with no process group: what the module held when it was wrapped."""

    def __init__(self, module, **_):
        super().__init__()
        self.module = module
        self.at_wrap = {n: p.detach().clone() for n, p in module.named_parameters()}


class _RecordingAdapter:
    name, version, area = "recording", "0", "ddp"

    def wrap(self, module, ctx, options):
        return DDPLikeWrapped(_Recording(module))


def _checkpoint(s, feats):
    """What `_round_trip` saves: a trained wrapper's state dict and an Adam state."""
    wrapped, optimizer, _ = ddp_features._construct(s, feats, _RecordingAdapter(), CTX, seed=5)
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return {"model": wrapped.ddp.state_dict(), "optimizer": optimizer.state_dict(), "engine_api": False}


@pytest.mark.parametrize("resume", orders.RESUME_ORDERS)
def test_a_resume_loads_where_its_order_says(resume):
    s = _row(round_trip="once", resume_order=resume, optimizer="adam")
    feats = Features.of(s)
    checkpoint = _checkpoint(s, feats)
    saved = orders.module_state(checkpoint["model"])
    wrapped, optimizer, late = ddp_features._construct(s, feats, _RecordingAdapter(), CTX, seed=6, checkpoint=checkpoint)
    at_wrap = wrapped.ddp.at_wrap
    assert all(torch.equal(p, saved[n]) for n, p in wrapped.module.named_parameters())  # loaded, in every order
    assert all(torch.equal(at_wrap[n], saved[n]) for n in at_wrap) == (resume == "load-wrap")
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in wrapped.module.parameters()]
    assert (late is not None) == (resume == "optimizer-late")
    assert (len(optimizer.state) == 0) == (resume == "optimizer-late")  # the state waits for the first backward
    if late is not None:
        optimizer.load_state_dict(late)
        assert len(optimizer.state) == len(saved)
