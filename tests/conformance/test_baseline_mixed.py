"""The oracle's model of a mixed-precision policy (conformance/oracle/baseline_mixed.py) and the rules of
the families that use it (conformance/catalogue/sharded_precision.py)."""

from dataclasses import replace

import torch
from torch import nn

from conformance.catalogue import sharded_precision
from conformance.oracle import baseline, baseline_mixed
from conformance.oracle.envelope import Envelope, reference


def _scenario(sid: str):
    return next(s for s in sharded_precision.scenarios() if s.id == sid)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight  # shared: the cast copy must share it too

    def forward(self, x):
        return self.b(self.a(x))


def test_without_a_policy_the_oracle_forwards_the_masters_themselves():
    s = _scenario("sharded/nested-reshard-to-2/mlp/w4/fp32")
    model = Tied()
    params = list(model.parameters())
    assert baseline_mixed.compute_module(model, params, s) == (model, params)
    g = torch.ones(2)
    assert baseline_mixed.to_reduce_dtype(g, s) is g


def test_a_policy_forwards_bf16_casts_of_the_masters_on_bf16_inputs():
    s = _scenario("sharded/mp-bf16-reduce-fp32/mlp/w2/fp32")
    model = Tied()
    params = list(model.parameters())
    fwd, low = baseline_mixed.compute_module(model, params, s)
    assert [p.dtype for p in low] == [torch.bfloat16] * len(params)
    assert all(torch.equal(p.to(torch.bfloat16), q) for p, q in zip(params, low, strict=True))
    assert fwd.low.b.weight is fwd.low.a.weight  # shared stays shared
    out = fwd(torch.randn(2, 3))  # fp32 input, cast on the way in
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.sum(), low)
    assert {g.dtype for g in grads} == {torch.bfloat16}
    assert baseline_mixed.to_reduce_dtype(grads[0], s).dtype == torch.float32  # reduce_dtype=fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters are untouched


def test_an_envelope_is_cast_back_exactly():
    bf = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    env = Envelope(bf, "summation-order", "f", candidates=torch.stack([bf, bf + 1]))
    back = baseline_mixed.to_master_dtype(env, torch.float32)
    assert back.reference.dtype == back.candidates.dtype == torch.float32
    assert bool(back.accepts(torch.tensor([2.0, 3.0])).all())  # the second candidate, in fp32
    assert not bool(back.accepts(torch.tensor([2.5, 3.0]))[0])


def test_the_oracle_tells_bf16_compute_and_the_reduce_dtype_apart_at_two_ranks():
    s = _scenario("sharded/mp-bf16-reduce-fp32/mlp/w2/fp32")
    plain = s.with_(options=replace(s.options, param_dtype=None, reduce_dtype=None))
    low_reduce = s.with_(options=replace(s.options, reduce_dtype="bfloat16"))
    grads = [baseline.compute(x).events[0].per_rank[0] for x in (s, plain, low_reduce)]
    name = "layers.0.weight"
    mp, fp32, bf16 = (reference(g[name]) for g in grads)
    assert mp.dtype == fp32.dtype == bf16.dtype == torch.float32  # cast back to the masters' dtype
    assert not torch.equal(mp, fp32)  # bf16 compute shows
    assert not torch.equal(mp, bf16)  # a bf16 reduce shows (the fp32 sum of two bf16 shares needs more bits)
    assert torch.equal(bf16, bf16.to(torch.bfloat16).float())  # the bf16 sum, cast back exactly


def test_the_rules_bitwise_at_two_ranks_bounded_where_bf16_sums_four():
    kinds = {s.id: s.tolerance.kind for s in sharded_precision.mixed_precision_scenarios()}
    assert kinds["sharded/mp-bf16-reduce-bf16/mlp/w4/fp32"] == "derived-bound"
    assert kinds["sharded/mp-bf16-reduce-fp32/mlp/w4/fp32"] == "summation-order"
    w2 = [s for s in sharded_precision.mixed_precision_scenarios() if s.world_size == 2]
    assert w2 and all(s.tolerance.kind == "summation-order" for s in w2)  # order-free at two: bitwise
    assert all("S19" in s.clauses for s in sharded_precision.mixed_precision_scenarios())
    assert all("S20" in s.clauses for s in sharded_precision.reshard_int_scenarios())


def test_the_production_training_oracle_composes_the_policy():
    # Issue 38: a policy with clipping (or a state-dict round trip) runs in the production loop's
    # oracle; its gradients are the plain oracle's (bf16 compute, reduced, cast back to fp32), not
    # fp32 compute's. Clipping far above the norm leaves the first synced gradient as it is.
    from conformance.oracle import baseline_features

    plain = _scenario("sharded/mp-bf16-reduce-bf16/mlp/w2/fp32")
    clipped = plain.with_(features=(("clip", 2.0**20),), id=plain.id + "/clip")
    want = next(e for e in baseline.compute(plain).events if e.kind == "backward").per_rank[0]
    got = next(e for e in baseline_features.compute(clipped).events if e.kind == "backward").per_rank[0]
    fp32 = next(e for e in baseline_features.compute(clipped.with_(options=replace(plain.options, param_dtype=None,
                                                                                   reduce_dtype=None))).events
                if e.kind == "backward").per_rank[0]
    for name, g in want.items():
        assert reference(got[name]).dtype == torch.float32
        assert torch.equal(reference(got[name]), reference(g)), name
    assert any(not torch.equal(reference(fp32[n]), reference(g)) for n, g in want.items())
