"""Production-training scenarios an adapter cannot run are skipped when planned, with the reason."""

from __future__ import annotations

from conformance import catalogue
from conformance.adapters import registry
from conformance.adapters.engines import production_features
from conformance.adapters.feature_support import unsupported
from conformance.adapters.protocol import OptimizerSpec
from conformance.spec import Capability as C


def _scenario(family: str, w: int = 2):
    hits = [s for s in catalogue.select(profile="full") if s.id.startswith(f"ddp/{family}/") and s.world_size == w]
    assert hits, family
    return hits[0]


class _Owner:
    """A protocol-v2 adapter that is not DDP-like (no `.ddp`) and owns everything."""

    name, version, area = "owner", "0", "ddp"
    capabilities = frozenset(C)
    owns = frozenset({"optimizer", "backward", "zero_grad"})
    ddp_module = False

    def wrap(self, module, ctx, options, optimizer=None):  # never called here
        raise AssertionError


def test_an_engine_that_owns_backward_gets_no_grad_scaler_scenario():
    why = unsupported(_Owner(), _scenario("autocast-bf16-scaler"))
    assert why and "owns backward" in why
    assert unsupported(_Owner(), _scenario("autocast-bf16")) is None  # autocast alone runs


def test_wrapper_compile_join_and_round_trip_need_a_ddp_module_or_a_checkpoint_api():
    owner = _Owner()
    assert "DDP-like module" in unsupported(owner, _scenario("compile-wrapper"))
    assert "join()" in unsupported(owner, _scenario("join-uneven"))
    assert "checkpoint" in unsupported(owner, _scenario("checkpoint-round-trip"))
    owner.checkpoint_api = True
    assert unsupported(owner, _scenario("checkpoint-round-trip")) is None


def test_ddp_like_engines_run_every_feature_the_suite_models():
    for name in ("torch-zero", "torch-ddp-powersgd"):
        adapter = registry.load(name)
        for family in ("compile-wrapper", "checkpoint-round-trip", "clip-grad-norm", "autocast-bf16-scaler"):
            assert unsupported(adapter, _scenario(family)) is None, (name, family)


def test_an_engines_table_gives_the_documented_reason():
    table = {"grad_scaler": "the engine scales its own loss"}
    assert production_features(_scenario("grad-scaler"), table) == "the engine scales its own loss"
    assert production_features(_scenario("clip-grad-norm"), table) is None
    assert "Joinable" in registry.load("torch-zero").unavailable(_scenario("join-uneven"))


def test_an_owned_optimizer_gets_the_production_learning_rate_and_clip():
    import torch

    spec = OptimizerSpec("sgd", lr=2.0**-10, clip=4.0)
    opt = spec.build([torch.nn.Parameter(torch.ones(2))])
    assert opt.param_groups[0]["lr"] == 2.0**-10 and spec.hyperparameters["lr"] == 2.0**-10
    assert OptimizerSpec("sgd").hyperparameters["lr"] == 2.0**-4  # the base catalogue's rate, unchanged


def test_an_engine_that_owns_the_optimizer_has_none_to_build_before_wrapping():
    from conformance.space.ddp_rows import DEFAULTS, scenario

    first = scenario(dict(DEFAULTS, build_order="optimizer-first"), frozenset({"standard"}))
    assert "no user optimizer to build before wrapping" in unsupported(_Owner(), first)
    assert unsupported(registry.load("torch-ddp"), first) is None
    late = scenario(dict(DEFAULTS, round_trip="once", resume_order="load-wrap"), frozenset({"standard"}))
    owner = _Owner()
    owner.checkpoint_api = True
    assert "needs torch DDP's state_dict" in unsupported(owner, late)
    assert unsupported(registry.load("torch-ddp"), late) is None


def test_a_resume_order_other_than_wrap_load_needs_torch_ddps_state_dict_not_an_engines_checkpoint_api():
    # torch-zero is DDP-like, but its round trip restores model and optimizer in one call after
    # building (ZeroRedundancyOptimizer's consolidated state): loading the module before wrapping
    # fed that checkpoint to the bare module ("Unexpected key(s): model, optimizer").
    standard = [s for s in catalogue.select(area="ddp", profile="standard") if "build-optimizer-first" not in s.id]
    rows = [s for s in standard if "reload-load-wrap" in s.id]
    late = [s for s in standard if "reload-optimizer-late" in s.id]
    assert rows and late
    zero, ddp = registry.load("torch-zero"), registry.load("refimpl-ddp")
    for s in (rows[0], late[0]):
        assert "checkpoint API" in unsupported(zero, s)
        assert unsupported(ddp, s) is None
