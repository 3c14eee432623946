"""conformance/models/user.py and conformance/catalogue/user_model.py: the user's build, batch and
loss resolve by reference, break their contract with one line, and become scenarios named after
the user's model, with the continuous-data rules."""

from __future__ import annotations

import pytest
import torch

from conformance.catalogue import user_model
from conformance.models import data, rng, user
from tests.conformance import user_models

MOD = "tests.conformance.user_models"
SPEC = user.UserModel(f"{MOD}:build", f"{MOD}:batch", f"{MOD}:loss")


@pytest.mark.parametrize(("build", "message"), [
    ("justaname", "expected pkg.module:function"),
    ("nope.mod:build", "cannot import 'nope.mod'"),
    (f"{MOD}:missing", "has no attribute 'missing'"),
    (f"{MOD}:not_a_module", "returned str, not a torch.nn.Module"),
])
def test_a_bad_reference_or_build_is_one_line(build, message):
    with pytest.raises(user.UserModelError, match=message) as info:
        user.inspect(user.UserModel(build, SPEC.batch), data.loss_fn)
    assert "\n" not in str(info.value)


def test_inspect_finds_the_batch_size_and_which_generators_forward_draws_from():
    seen = user.inspect(SPEC, data.loss_fn)
    assert seen.batch_size == 8 and seen.unused == () and seen.randomness == ("torch",)
    plain = user.inspect(user.UserModel(f"{MOD}:build_no_dropout", SPEC.batch), data.loss_fn)
    assert plain.randomness == ()
    assert "python" in user.inspect(user.UserModel(f"{MOD}:build_python_random", SPEC.batch), data.loss_fn).randomness


def test_the_user_model_is_built_with_its_own_init_rank_dependent_and_called_without_rank_keywords():
    name = SPEC.encode()
    a, b = (data.build_model(name, {}, seed=0, rank=r) for r in (0, 1))
    assert type(a) is user_models.TinyNet
    assert not torch.equal(a.fc1.weight, b.fc1.weight)  # the user's init drew under a rank-dependent seed
    assert not torch.equal(a.fc1.weight, a.fc1.weight.round())  # not replaced by small integers
    (x,) = data.make_inputs(name, seed=0, rank=1, step=2, micro=1, size=0)
    inputs, target = user_models.batch(1, 2, 1)
    assert torch.equal(x.inputs, inputs) and torch.equal(x.target, target)
    a.eval()
    assert torch.equal(data.model_loss(a, name, x, rank=1, micro=1), user_models.loss(a(inputs), target))
    (half,) = data.make_inputs(name, seed=0, rank=1, step=0, micro=0, size=3)
    assert half.inputs.shape[0] == 3 and half.target.shape[0] == 3


def test_a_callable_becomes_a_reference_the_ranks_import_and_a_lambda_is_refused():
    ref, path = user.ref_of(user_models.build, "build")
    assert ref == f"{MOD}:build" and user.resolve(ref, "model", path) is user_models.build
    with pytest.raises(user.UserModelError, match="not importable"):
        user.ref_of(lambda: None, "build")


def test_user_scenarios_name_the_model_and_use_continuous_rules():
    out = user_model.scenarios(SPEC.encode(), SPEC.name, world_sizes=(2, 4), batch_size=8, randomness=("torch",))
    ids = [s.id for s in out]
    assert "ddp/plain/tests.conformance.user_models:build/w2/fp32" in ids
    assert not any("compile" in i for i in ids)  # not replayable with dropout: never planned
    assert {s.tolerance.kind for s in out if s.world_size == 4} == {"summation-order"}
    uneven = next(s for s in out if s.id.startswith("ddp/uneven/") and s.world_size == 4)
    assert uneven.shard_sizes == (8, 4, 8, 4) and all(not s.exact_data for s in out)
    with pytest.raises(ValueError, match="unknown families"):
        user_model.scenarios(SPEC.encode(), SPEC.name, families=("nope",))


def test_the_rng_probe_and_stream_start():
    assert rng.probe(lambda: torch.rand(1)) == ["torch"] and rng.probe(lambda: None) == []
    before = torch.get_rng_state()
    assert rng.same(rng.start(3, 0), rng.start(3, 0)) and not rng.same(rng.start(3, 0), rng.start(4, 0))
    assert torch.equal(before, torch.get_rng_state())  # the caller's stream untouched


@pytest.mark.slow
def test_the_fixture_checks_a_users_model_from_their_own_test(pytester, monkeypatch):
    import os
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]  # the user's module lives under this repo's tests/
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pytester.path), str(repo), os.environ.get("PYTHONPATH", "")]))
    pytester.makepyfile(test_mine=f'''
        from {MOD} import build, batch, loss

        def test_my_model(gradparity_check):
            result = gradparity_check(build, batch, loss=loss, families=["plain", "no-sync"])
            assert result.ok, result.summary
            assert [r.case.id for r in result.results][0] == "torch-ddp|ddp/plain/{MOD}:build/w2/fp32"
    ''')
    out = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--adapter", "torch-ddp", "test_mine.py")
    out.assert_outcomes(passed=1)
