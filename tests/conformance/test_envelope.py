"""The summation-order envelope (conformance/oracle/envelope.py): what it accepts and what it rejects."""

import itertools

import pytest
import torch

from conformance.oracle.envelope import Envelope, gamma, reduce, rule_of, summation_trees, ulp
from conformance.semantics import TORCH_DDP, Scaling, Semantics, reduce_dtype_bound
from conformance.spec import EXACT, derived_bound, float_tolerance, summation_order
from tests.conformance.area_cases import scenario

ORDER3, ORDER4 = summation_order("float32", 3), summation_order("float32", 4)


def _grads(n, size=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) * (10 ** (i % 3)) for i in range(n)]


@pytest.mark.parametrize(("n", "trees"), [(1, 1), (2, 1), (3, 3), (4, 15)])
def test_every_summation_tree_once(n, trees):
    assert len(summation_trees(list(range(n)))) == trees


@pytest.mark.parametrize("rule", [ORDER3, ORDER4], ids=["w3", "w4"])
def test_every_order_and_parenthesization_is_accepted(rule):
    n = 3 if rule is ORDER3 else 4
    grads = _grads(n)
    env = reduce(grads, n, rule)
    assert isinstance(env, Envelope) and env.rule == "summation-order"
    shares = [g / n for g in grads]
    for perm in itertools.permutations(range(n)):  # every left-to-right order
        total = shares[perm[0]]
        for i in perm[1:]:
            total = total + shares[i]
        assert env.accepts(total).all()
    if n == 4:  # a balanced tree (halving-doubling) is not a left-to-right order
        assert env.accepts((shares[0] + shares[2]) + (shares[1] + shares[3])).all()


@pytest.mark.parametrize("rule", [ORDER3, ORDER4], ids=["w3", "w4"])
def test_one_ulp_is_caught_wherever_the_orders_agree(rule):
    n = 3 if rule is ORDER3 else 4
    env = reduce(_grads(n), n, rule)
    single = (env.candidates == env.reference).all(0)
    assert single.float().mean() > 0.25  # many elements have one possible value (mixed magnitudes here)
    index = int(single.nonzero()[0])
    bumped = env.reference.clone()
    bumped[index] = torch.nextafter(bumped[index], torch.tensor(float("inf")))
    accepted = env.accepts(bumped)
    assert not accepted[index] and int((~accepted).sum()) == 1
    value, outside = env.nearest(bumped)
    assert float(outside[index] / ulp(env.reference)[index]) == pytest.approx(1.0)


def test_two_shares_and_order_free_data_stay_bitwise():
    assert isinstance(reduce(_grads(2), 2, summation_order("float32", 2)), torch.Tensor)
    ints = [torch.randint(-8, 8, (64,)).float() for _ in range(4)]
    assert isinstance(reduce(ints, 4, ORDER4), torch.Tensor)  # every order agrees: plain tensor, bitwise
    assert reduce([None, None], 2, EXACT) is None


def test_torch_ddp_multiplies_by_the_reciprocal_and_both_forms_are_pre_scaling():
    grads = _grads(3)
    env = reduce(grads, 3, ORDER3)
    assert env.accepts(sum(g * (1.0 / 3) for g in grads)).all()  # torch's reducer: mul_out by 1/W
    post = (grads[0] + grads[1] + grads[2]) / 3
    declared_post = reduce(grads, 3, rule_of(scenario("ddp/plain/mlp/w3/fp32"), Semantics(scaling=Scaling.POST)))
    assert declared_post.accepts(post).all()
    assert not env.accepts(post).all()  # not torch DDP's rule unless declared


def test_a_bf16_reduction_and_a_99_percent_gradient_leave_an_fp32_envelope():
    grads = _grads(4)
    env = reduce(grads, 4, ORDER4)
    in_bf16 = sum(g.bfloat16() / 4 for g in grads).float()
    assert not env.accepts(in_bf16).all() and not env.accepts(env.reference * 0.99).any()


def test_derived_bound_holds_for_every_order_of_a_low_precision_sum_and_is_tight():
    grads = [g.bfloat16() for g in _grads(4)]
    env = reduce(grads, 4, derived_bound("bfloat16", 4))
    assert env.rule == "derived-bound" and "γ_3" in env.formula
    shares = [g / 4 for g in grads]
    for tree in summation_trees(shares):
        assert env.accepts(tree).all()
    exact = sum(s.double() for s in shares)
    assert env.accepts(exact.bfloat16()).all()  # a backend that accumulates wider, rounds once
    assert not env.accepts((exact * 1.05).bfloat16()).all()
    width, _ = env.spread()
    assert width <= 2 * (gamma(3, 2.0**-8) + 1e-12) * float(sum(s.double().abs() for s in shares).max()) + 1e-30


def test_declared_reduce_dtype_accepts_the_cast_reduction_and_rejects_an_unreduced_share():
    grads = _grads(3)
    rule = reduce_dtype_bound("bfloat16", 3)
    env = reduce(grads, 3, rule)
    assert env.accepts(sum(g.bfloat16() / 3 for g in grads).float()).all()
    assert not env.accepts(grads[0] / 3).all()


def test_a_band_keeps_the_rank_order_value():
    grads = _grads(3)
    value = reduce(grads, 3, float_tolerance("float32", 3))
    assert isinstance(value, torch.Tensor) and torch.equal(value, grads[0] / 3 + grads[1] / 3 + grads[2] / 3)


def test_nan_only_where_an_order_gives_nan():
    grads = [torch.tensor([1.0, float("inf")]), torch.tensor([2.0, 1.0]), torch.tensor([0.5, 1.0])]
    env = reduce(grads, 3, ORDER3)
    value = env.reference if isinstance(env, Envelope) else env
    assert torch.isinf(value[1])
    nan = value.clone()
    nan[1] = float("nan")
    assert isinstance(env, torch.Tensor) or not env.accepts(nan)[1]


def test_rule_of_prefers_a_declared_lossy_rule():
    s = scenario("ddp/plain/mlp/w3/fp32")
    assert rule_of(s, TORCH_DDP) == s.tolerance
    lossy = Semantics(lossy=reduce_dtype_bound("float16", 3))
    assert rule_of(s, lossy).kind == "derived-bound"


def test_beyond_four_ranks_ring_orders_and_the_derived_bound():
    grads = _grads(6)
    env = reduce(grads, 6, summation_order("float32", 6))
    assert env.rule == "summation-order" and "ring order" in env.formula and env.radius is not None
    shares = [g / 6 for g in grads]
    pairwise = ((shares[0] + shares[1]) + (shares[2] + shares[3])) + (shares[4] + shares[5])
    assert env.accepts(pairwise).all()  # a tree order, inside the derived bound
    assert not env.accepts(env.reference * 0.999).all()


def test_a_power_of_two_division_that_underflows_is_within_the_derived_bound():
    """join(): one active rank of two, its fp16 share halved. 2**-24 / 2 rounds to 0 in fp16 (the
    smallest subnormal halved), so an exact division is exact only above the subnormals."""
    g = torch.tensor([2.0**-24, 3 * 2.0**-24, 1.0], dtype=torch.float16)
    env = reduce([g], 2, derived_bound("float16", 2))
    engine = g / 2  # fp16: [0, 2**-23 (ties to even), 0.5]
    assert engine[0] == 0 and env.accepts(engine).all()
    assert not env.accepts(torch.tensor([2.0**-23, 2.0**-23, 0.5], dtype=torch.float16)).all()
