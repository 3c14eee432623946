"""The engine adapters load without their engine and say how to install it (no processes)."""

from __future__ import annotations

import pytest
import torch

from conformance.adapters import registry
from conformance.adapters.engines import probe
from conformance.adapters.protocol import owned
from conformance.catalogue import ddp


def test_a_missing_engine_is_a_skip_with_the_install_command():
    version, why = probe("no_such_engine_module", "no-such-engine", "pip install no-such-engine")
    assert version == "not installed"
    assert "no-such-engine cannot be imported" in why and "pip install no-such-engine" in why


def test_engines_are_built_in_but_not_run_by_default():
    assert set(registry.ENGINE_ADAPTERS) <= set(registry.BUILTINS)
    assert not set(registry.ENGINE_ADAPTERS) & set(registry.DEFAULT_ADAPTERS)
    for name in registry.ENGINE_ADAPTERS:
        adapter = registry.load(name)
        assert adapter.name == name and adapter.area in ("ddp", "sharded")  # deepspeed-zero3-sharded: the sharded area
        owned(adapter)  # only ownable parts


def test_torch_zero_owns_the_optimizer_and_powersgd_declares_its_bound():
    assert owned(registry.load("torch-zero")) == {"optimizer"}
    powersgd = registry.load("torch-ddp-powersgd")
    assert powersgd.semantics.lossy is None and powersgd.semantics.communication is not None  # simulated, not bounded
    s = ddp.make("plain", "mlp")
    assert any("powerSGD_hook simulated" in d for d in powersgd.semantics.deviations())
    assert registry.load("pfn-ddp").semantics.deviations() == [
        "buffers: rank0-after-backward (torch DDP: rank0-before-forward)", "scaling: post (torch DDP: pre)"]
    assert registry.load("torch-replicate").semantics.deviations() == ["construction_sync: first-forward (torch DDP: eager)"]
    assert powersgd.unavailable(s) is None and powersgd.unavailable(s.with_(dtype="float16")) is not None


def test_fairscale_gathers_gradients_on_the_ranks_device(world1):
    """FairScale SDP's adapter broadcasts "has a gradient" flags: on the parameters' device (NCCL
    refuses a CPU tensor; the CPU stand-in of refimpl.device_check catches one built without device=)."""
    pytest.importorskip("fairscale")
    from torch import nn

    from conformance.adapters import registry
    from conformance.adapters.protocol import OptimizerSpec
    from conformance.harness.context import RankContext
    from conformance.spec import WrapOptions
    from conformance.topology import Topology
    from refimpl.device_check import expect_collective_device

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ctx = RankContext(0, Topology(1, "gloo", "cpu"), world1)
    wrapped = registry.load("fairscale-sdp").wrap(model, ctx, WrapOptions(), optimizer=OptimizerSpec("sgd"))
    wrapped(torch.ones(2, 3)).sum().backward()
    with expect_collective_device("cpu", stray="meta"):
        grads = wrapped.full_gradients()
    assert set(grads) == {"0.weight", "0.bias", "1.weight", "1.bias"} and all(g is not None for g in grads.values())


REALISTIC = ["ddp/plain/gpt/w2/fp32", "ddp/dropout/gpt/w3/fp32", "ddp/plain/llama/w3/fp32", "ddp/plain/moe/w2/fp32"]


@pytest.mark.parametrize("scenario_id", REALISTIC)
def test_deepspeed_zero2_on_the_realistic_models(session, scenario_id):
    """Issue 39: ZeRO-2 trains GPT (dropout replayed) and Llama (3 steps at 3 ranks) like one process; on
    the MoE, an expert unused on one rank makes the ranks' ZeRO-2 buckets differ and a rank aborts, as
    its strict xfail entry says (conformance/adapters/xfails/deepspeed-zero2.txt)."""
    from conformance.pipeline import Case, run_case
    from tests.conformance.area_cases import scenario

    s = scenario(scenario_id)
    why = registry.load("deepspeed-zero2").unavailable(s)
    if why:
        pytest.skip(why)  # names the install command
    result = run_case(Case(s, "deepspeed-zero2"), session)
    if s.model == "moe":
        assert result.verdict == "failed" and result.failure.failure_class.value == "crashed", result.message
        assert any(w in result.message for w in ("Received data size", "Connection reset")), result.message
    else:
        assert result.verdict == "passed", result.message


@pytest.mark.parametrize("supported", [False, True])
def test_deepspeed_fp16_on_a_cpu_without_onednn_fp16_is_a_skip_saying_so(monkeypatch, supported):
    """DeepSpeed's CPU accelerator raises at initialize for fp16 where oneDNN has no fp16 (a machine's
    property): the case is skipped with that reason, never run into a false failure; elsewhere it runs."""
    from conformance.adapters.engines import deepspeed

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: supported, raising=False)
    fp16, fp32 = ddp.make("plain", "mlp").with_(dtype="float16"), ddp.make("plain", "mlp")
    why = deepspeed.fp16_refused_here(fp16)
    assert (why is None) == supported and deepspeed.fp16_refused_here(fp32) is None
    if not supported:
        assert "Type fp16 is not supported on your device" in why


def test_deepspeed_scaling_the_loss_is_a_skip_for_a_model_whose_backward_is_not_linear_in_it():
    """DeepSpeed divides the loss by gradient_accumulation_steps (fp16: multiplies it by the loss scale)
    before backward; the MoE's aux loss gets a fixed gradient, so that scale misses it and the oracle's
    per-gradient scaling is not the engine's: a skip that says so (it was a false failure), while one
    micro-batch in fp32, and the MLP with two, still run."""
    from conformance.adapters.engines.deepspeed import engine_loop_limits

    moe = ddp.make("no-sync", "moe").with_(micro_batches=2)
    assert moe.micro_batches > 1 and "aux loss gets a fixed gradient" in engine_loop_limits(moe)
    assert "aux loss" in engine_loop_limits(moe.with_(micro_batches=1, dtype="float16"))
    assert engine_loop_limits(moe.with_(micro_batches=1)) is None
    assert engine_loop_limits(ddp.make("plain", "mlp").with_(micro_batches=2)) is None
