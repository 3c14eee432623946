"""Declared semantics: the oracle models each declared rule exactly (no processes).

Each test computes the oracle under torch DDP's rules and under one declared deviation, and
checks the difference is exactly the declared one, so a declaration can never switch a check
off: records right under one rule are wrong under the other.
"""

from __future__ import annotations

import pytest
import torch

from conformance.catalogue import ddp
from conformance.judge.compare import ConformanceError
from conformance.judge.contract import check_records
from conformance.oracle import baseline
from conformance.oracle.envelope import reference
from conformance.semantics import (
    TORCH_DDP,
    Accumulation,
    Buffers,
    ConstructionSync,
    Semantics,
    Unused,
)
from conformance.spec import Tolerance


def _scenario(name: str, model: str, **kw):
    return ddp.make(name, model, **kw)


def _records(b: baseline.Baseline) -> dict[int, dict]:
    """What an implementation exactly following `b` would report."""
    W = b.scenario.world_size
    out = {}
    for r in range(W):
        params, buffers = b.init_for(r)
        events = []
        for e in b.events:
            values = None if e.per_rank[r] is None else {n: reference(v) for n, v in e.per_rank[r].items()}
            ev = {"kind": e.kind, "step": e.step, "micro": e.micro, "synced": e.synced, "values": values}
            if e.kind == "step":
                ev["buffers"] = e.buffers[r] if e.buffers and e.buffers[r] is not None else {}
            events.append(ev)
        out[r] = {"init": {"parameters": params, "buffers": buffers}, "events": events, "error": None}
    return out


def test_torch_ddp_declares_nothing_and_others_list_each_deviation():
    assert TORCH_DDP.deviations() == [] and TORCH_DDP.describe() == "torch DDP semantics"
    sem = Semantics(unused=Unused.ZEROS, buffers=Buffers.NEVER, lossy=Tolerance(False, 0.1, 0.1, "rank-1 PowerSGD"))
    text = "\n".join(sem.deviations())
    assert "unused: zeros (torch DDP: none)" in text and "buffers: never" in text and "rank-1 PowerSGD" in text


def test_unused_as_zeros_is_modelled_and_checked():
    s = _scenario("unused-on-all", "branches", options=ddp.FUF, model_kwargs={"mode": "unused-all"})
    zeros = Semantics(unused=Unused.ZEROS)
    plain, declared = baseline.compute(s), baseline.compute(s, zeros)
    names = [n for n, g in plain.events[0].per_rank[0].items() if g is None]
    assert names, "the scenario must have a parameter no rank uses"
    for n in names:
        assert torch.equal(declared.events[0].per_rank[0][n], torch.zeros_like(plain.init_params[n]))
    check_records(s, "meta", declared, _records(declared), semantics=zeros)
    with pytest.raises(ConformanceError, match="expected grad None"):
        check_records(s, "meta", plain, _records(declared))  # zeros are wrong for torch DDP's rule
    with pytest.raises(ConformanceError, match="expected a gradient but got None"):
        check_records(s, "meta", declared, _records(plain), semantics=zeros)  # None is wrong when zeros are declared


def test_construction_sync_at_first_forward_expects_each_rank_own_parameters():
    s = _scenario("plain", "mlp")
    lazy = Semantics(construction_sync=ConstructionSync.FIRST_FORWARD)
    b = baseline.compute(s, lazy)
    p0, _ = b.init_for(0)
    p1, _ = b.init_for(1)
    assert any(not torch.equal(p0[n], p1[n]) for n in p0)
    check_records(s, "meta", b, _records(b), semantics=lazy)
    with pytest.raises(ConformanceError, match="construction-time broadcast"):
        check_records(s, "meta", baseline.compute(s), _records(b))
    with pytest.raises(ConformanceError, match="own initial parameters"):
        check_records(s, "meta", b, _records(baseline.compute(s)), semantics=lazy)


@pytest.mark.parametrize("rule", [Buffers.NEVER, Buffers.AFTER_BACKWARD, Buffers.CONSTRUCTION_ONLY])
def test_each_buffer_rule_changes_what_is_expected(rule):
    s = _scenario("buffers", "buffered", steps=3)
    sem = Semantics(buffers=rule)
    torch_rule, declared = baseline.compute(s), baseline.compute(s, sem)
    check_records(s, "meta", declared, _records(declared), semantics=sem)
    with pytest.raises(ConformanceError):
        check_records(s, "meta", torch_rule, _records(declared))
    if rule == Buffers.AFTER_BACKWARD:  # after a synced backward every rank holds rank 0's buffers
        last = declared.events[-1].buffers
        assert all(torch.equal(last[0][n], last[1][n]) for n in last[0])


def test_mean_accumulation_divides_by_the_number_of_micro_batches():
    s = _scenario("no-sync", "mlp", micro_batches=2)
    mean = Semantics(accumulation=Accumulation.MEAN)
    summed, averaged = baseline.compute(s), baseline.compute(s, mean)
    synced = [i for i, e in enumerate(summed.events) if e.kind == "backward" and e.synced][0]
    for n, g in summed.events[synced].per_rank[0].items():
        assert torch.equal(averaged.events[synced].per_rank[0][n], g / 2)


def test_alternating_set_to_none_leaves_never_used_parameters_none():
    s = _scenario("set-to-none-alternate", "branches", steps=3, zero_grad="alternate", options=ddp.FUF,
                  model_kwargs={"mode": "unused-all"})
    b = baseline.compute(s)
    synced = [e for e in b.events if e.kind == "backward"]
    unused = [n for n, g in synced[0].per_rank[0].items() if g is None]
    # zero_grad(set_to_none=False) zeroes existing gradients only: a never-used one stays None.
    assert unused and all(e.per_rank[0][n] is None for e in synced for n in unused)
    used = [n for n, g in synced[0].per_rank[0].items() if g is not None]
    plain = baseline.compute(s.with_(zero_grad="optimizer", id=s.id + "-plain"))
    for e, p in zip(synced, [e for e in plain.events if e.kind == "backward"], strict=True):
        assert all(torch.equal(e.per_rank[0][n], p.per_rank[0][n]) for n in used)


def test_a_lossy_bound_is_a_whole_tensor_relative_l2_bound():
    from conformance.judge.compare import compare_tensor

    bound = Tolerance(False, norm_rtol=1.0, reason="projection")
    g = torch.tensor([[3.0, 0.0], [0.0, 4.0]])  # ||g|| = 5
    assert compare_tensor("w", g, torch.zeros(2, 2), bound) is None  # error 5 == bound
    assert compare_tensor("w", g, g + 0.5, bound) is None
    far = compare_tensor("w", g, -g, bound)  # a sign flip: error 10 > 5
    assert far is not None and "exceeds the bound" in far.problem
    assert compare_tensor("w", g, torch.full((2, 2), float("nan")), bound) is not None


def test_a_declared_lossy_bound_replaces_the_tolerance_but_ranks_stay_bitwise():
    s = _scenario("plain", "mlp", steps=1)
    lossy = Semantics(lossy=Tolerance(False, norm_rtol=1.0, reason="projection"))
    b = baseline.compute(s, lossy)
    records = _records(b)
    grads = records[1]["events"][0]["values"]
    records[1]["events"][0]["values"] = {n: g * 1.01 for n, g in grads.items()}  # within the bound ...
    with pytest.raises(ConformanceError, match="not bitwise identical to rank 0"):  # ... but ranks differ
        check_records(s, "meta", b, records, semantics=lossy)
    for r in records.values():
        r["events"][0]["values"] = {n: g * 1.01 for n, g in grads.items()}
    check_records(s, "meta", b, records, semantics=lossy)


def test_a_reduce_dtype_scenario_makes_ddp_like_adapters_declare_its_bound():
    """mixed_precision(reduce_dtype=...): declared (one ulp per summand, at least two), then checked."""
    from conformance.adapters import registry
    from conformance.semantics import declared, reduce_dtype_bound
    from conformance.spec import Capability, WrapOptions

    s = _scenario("reduce-bf16", "mlp", options=WrapOptions(reduce_dtype="bfloat16"))
    assert Capability.MIXED_PRECISION in s.requires and s.steps == 1 and not s.exact_data
    for name in ("refimpl-ddp", "torch-ddp"):
        semantics = declared(registry.load(name), s)
        assert semantics.lossy == reduce_dtype_bound("bfloat16", 2)
        assert semantics.lossy.kind == "derived-bound" and semantics.lossy.sum_dtype == "bfloat16"
        assert semantics.lossy.roundings == 1  # the cast of each share (the divide counts by itself)
        assert semantics.lossy.straight_through.rtol == 2 * 2.0**-7  # the old band: two bf16 ulps
        assert any(d.startswith("lossy communication") for d in semantics.deviations())
        plain = declared(registry.load(name), _scenario("plain", "mlp"))
        assert plain == TORCH_DDP  # refimpl divides before the sum too
    assert reduce_dtype_bound("float16", 4).straight_through.rtol == 4 * 2.0**-10
    powersgd = registry.load("torch-ddp-powersgd")  # a subclass keeps its own declaration
    assert declared(powersgd, _scenario("plain", "mlp")) == powersgd.semantics
    # The bound is what is checked: one bf16 rounding passes, a share kept unreduced does not.
    b = baseline.compute(s, declared(registry.load("refimpl-ddp"), s))
    records = _records(b)
    for r in records.values():
        r["events"][0]["values"] = {n: g.bfloat16().float() for n, g in r["events"][0]["values"].items()}
    check_records(s, "meta", b, records, semantics=declared(registry.load("refimpl-ddp"), s))
    with pytest.raises(ConformanceError, match="gradients differ from the oracle"):
        check_records(s, "meta", baseline.compute(s), records)  # undeclared: fp32, bitwise at two ranks


def test_sharded_areas_do_not_reuse_reduce_dtype_scenarios():
    from conformance import catalogue

    assert any(s.options.reduce_dtype for s in catalogue.select(area="ddp", profile="standard"))
    # The sharded area's reduce_dtype comes only with its own MixedPrecisionPolicy family (a
    # param_dtype too, modelled by conformance/oracle/baseline_mixed.py), never DDP's reduce_dtype scenarios.
    sharded = [s for s in catalogue.select(area="sharded", profile="full") if s.options.reduce_dtype]
    assert sharded and all(s.options.param_dtype and "/mp-" in s.id for s in sharded), [s.id for s in sharded]
