"""conformance.oracle.clip_bound: the derived bound for a step clipped by a reordered global norm.

Every way a sharded engine evaluates the norm (shards' squared sums all-reduced in any order,
norms of norms, float64 accumulation) lands inside the derived norm interval, so its coefficient
lies in [c_lo, c_hi] and its SGD-with-momentum steps, re-anchored like the oracle's, stay inside
the per-element bound for five steps; a local-norm clip (pytorch/pytorch#170862) does not.
Through the suite (gloo worlds, slow): refimpl ZeRO-2 passes sharded/clip-grad-norm, the zoo's
`clip-local-norm` mutant fails it at the first step.
"""

import math

import pytest
import torch

from conformance.judge.compare import ConformanceError, compare_tensor
from conformance.oracle.clip_bound import ClipBound
from conformance.spec import EXACT

MAX_NORM = 1.0


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(37, 5, generator=g) * 3, torch.randn(11, generator=g), torch.randn(4, 9, generator=g) * 0.01]


def _shard_norm(grads, world: int, order) -> torch.Tensor:
    """A sharded engine's norm: each rank's flat chunk squared and summed, the ranks' sums added in `order`."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    chunks = flat.tensor_split(world)
    partial = [(c * c).sum() for c in chunks]
    total = partial[order[0]]
    for r in order[1:]:
        total = total + partial[r]
    return total.sqrt()


def _norms_of_norms(grads) -> torch.Tensor:  # FSDP1 / torch's clip_grad_norm_ shape of computation
    return (torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) ** 2) ** 0.5


def _clip(grads, norm) -> list[torch.Tensor]:
    coef = (MAX_NORM / (norm + 1e-6)).clamp(max=1.0)
    return [g * coef.to(g.dtype) for g in grads]


def _params(grads):
    return [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]


def test_every_evaluation_of_the_norm_lies_in_the_derived_interval():
    for seed in range(20):
        grads = _grads(seed)
        params = _params(grads)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        bound = ClipBound(MAX_NORM, torch.optim.SGD(params, lr=2.0**-10, momentum=0.5))
        c_lo, c_hi = bound.before_clip(params)
        n_lo, n_hi = bound.norm_interval
        evaluations = [
            torch.nn.utils.get_total_norm(grads),
            _norms_of_norms(grads),
            _shard_norm(grads, 2, [0, 1]), _shard_norm(grads, 4, [3, 1, 0, 2]), _shard_norm(grads, 3, [2, 1, 0]),
            torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).float(),
        ]
        for n in evaluations:
            assert n_lo <= float(n) <= n_hi, (seed, float(n), n_lo, n_hi)
            coef = float((MAX_NORM / (n + 1e-6)).clamp(max=1.0))
            assert c_lo <= coef <= c_hi
        assert c_hi < 1.0 and (c_hi - c_lo) / c_lo < 1e-4  # clipping is active; the interval is narrow


def _train(norm_of, steps: int = 5, seed: int = 3):
    """An 'engine' clipping with `norm_of(grads)` against the oracle (torch's clip_grad_norm_),
    re-anchored on the engine's parameters every step as the suite does; yields (step, bad elements)."""
    engine = _params(_grads(0))
    oracle = _params(_grads(0))
    e_opt = torch.optim.SGD(engine, lr=2.0**-10, momentum=0.5)
    o_opt = torch.optim.SGD(oracle, lr=2.0**-10, momentum=0.5)
    bound = ClipBound(MAX_NORM, o_opt)
    named = [(f"p{i}", p) for i, p in enumerate(oracle)]
    for step in range(steps):
        grads = _grads(seed + step)
        with torch.no_grad():  # re-anchor: the oracle continues from the engine's parameters
            for o, e in zip(oracle, engine, strict=True):
                o.copy_(e)
        for p, g in zip(engine, _clip(grads, norm_of(grads)), strict=True):
            p.grad = g
        e_opt.step()
        for p, g in zip(oracle, grads, strict=True):
            p.grad = g.clone()
        bound.before_clip(oracle)
        bound.check_norm(float(torch.nn.utils.clip_grad_norm_(oracle, MAX_NORM)))
        o_opt.step()
        radii = bound.after_step(named)
        expected = bound.envelopes({n: p.detach().clone() for n, p in named}, radii)
        bad = [compare_tensor(n, expected[n], engine[i].detach(), EXACT) for i, (n, _) in enumerate(named)]
        yield step, [b for b in bad if b is not None]


@pytest.mark.parametrize("norm_of", [
    lambda g: _shard_norm(g, 2, [1, 0]), lambda g: _shard_norm(g, 4, [2, 0, 3, 1]), _norms_of_norms,
], ids=["w2-reversed", "w4-shuffled", "norm-of-norms"])
def test_a_reordered_norm_stays_inside_the_bound_for_five_steps(norm_of):
    for step, bad in _train(norm_of):
        assert not bad, (step, bad[0].render())


def test_a_reordered_norm_is_not_bitwise_so_the_bound_is_needed():
    seeds = range(30)
    engines = [[_shard_norm(_grads(s), 4, [2, 0, 3, 1]) for s in seeds], [_shard_norm(_grads(s), 2, [1, 0]) for s in seeds],
               [_norms_of_norms(_grads(s)) for s in seeds]]
    oracle = [torch.nn.utils.get_total_norm(_grads(s)) for s in seeds]
    differ = [sum(not torch.equal(a, b) for a, b in zip(e, oracle, strict=True)) for e in engines]
    assert sum(differ) > 0, differ


def test_a_local_norm_clip_is_caught_at_the_first_step():
    def local(grads):  # rank 0's shard alone (pytorch/pytorch#170862)
        flat = torch.cat([g.reshape(-1) for g in grads])
        return flat.tensor_split(2)[0].norm()

    step, bad = next(_train(local))
    assert step == 0 and bad and "outside the envelope (derived-bound" in bad[0].render()


def test_what_has_no_bound_is_refused_and_a_wrong_derivation_is_loud():
    params = _params(_grads(0))
    with pytest.raises(ValueError, match="no clip bound derived for Adam"):
        ClipBound(MAX_NORM, torch.optim.Adam(params))
    with pytest.raises(ValueError, match="nesterov"):
        ClipBound(MAX_NORM, torch.optim.SGD(params, lr=0.1, momentum=0.5, nesterov=True))
    bound = ClipBound(MAX_NORM, torch.optim.SGD(params, lr=0.1))
    for p, g in zip(params, _grads(0), strict=True):
        p.grad = g
    bound.before_clip(params)
    with pytest.raises(AssertionError, match="outside the derived"):
        bound.check_norm(bound.norm_interval[1] * (1 + 1e-3))


def test_nothing_clipped_means_bitwise():
    params = _params(_grads(0))
    for p, g in zip(params, _grads(0), strict=True):
        p.grad = g * 1e-4  # norm far below max_norm: c = 1 for every correct order
    opt = torch.optim.SGD(params, lr=2.0**-10, momentum=0.5)
    bound = ClipBound(MAX_NORM, opt)
    assert bound.before_clip(params) == (1.0, 1.0)
    opt.step()
    radii = bound.after_step([(f"p{i}", p) for i, p in enumerate(params)])
    assert all(float(r.max()) == 0.0 for r in radii.values())
    assert math.isclose(bound.norm_interval[0], bound.norm_interval[1], rel_tol=1e-4)


# -- through the suite: real gloo worlds ---------------------------------------------------------
CLIP_W2 = "sharded/clip-grad-norm/mlp/w2/fp32"


@pytest.mark.slow
def test_refimpl_passes_and_the_local_norm_mutant_fails(session):
    from conformance.pipeline import check
    from tests.conformance.area_cases import scenario

    checked = check(scenario(CLIP_W2), "refimpl-sharded", session)
    assert checked.details["oracle"]["envelopes"] > 0  # the clipped steps were judged by the bound
    with pytest.raises(ConformanceError) as info:
        check(scenario(CLIP_W2), "conformance.mutants.sharded:clip_local_norm", session)
    message = str(info.value)
    assert "after optimizer step 0" in message and "outside the envelope (derived-bound" in message, message
