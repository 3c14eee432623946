"""A CUDA plan's skips and expected failures are the CPU plan's plus the declared differences
([Note: expectations on every device] in conformance/expectations.py). Planning needs no GPU.

Declared differences, and nothing else:
- an adapter says a scenario cannot run on one device (`unavailable(scenario)`: torch DDP's
  mixed precision needs CUDA events, its bf16 hook NCCL): that skip on that device only;
- an entry ending in `/cpu` applies on the CPU only, one ending in `/cuda` on CUDA only;
- on CUDA an `ends-world:` expected failure is a skip that says why (NCCL hangs where gloo aborts).
"""

from __future__ import annotations

import pytest

from conformance.adapters import registry
from conformance.case import CASE_SEPARATOR
from conformance.expectations import (
    CUDA_ENDS_WORLD,
    builtin_xfails,
    ends_world,
    read_expectations,
    split_device,
)
from conformance.plan import Selection, _capability_skip, make_plan

ADAPTERS = tuple(registry.BUILTINS)  # every built-in adapter, each with its built-in expectations


def _device_entries(device: str) -> dict[tuple[str, str], str]:
    """(adapter name, scenario id) -> reason, for the built-in entries marked for `device` only."""
    out = {}
    for name in ADAPTERS:
        path = builtin_xfails(name)
        for entry, reason in (read_expectations(path).items() if path else ()):
            adapter, _, scenario_id = entry.partition(CASE_SEPARATOR)
            base, only = split_device(scenario_id)
            if only == device:
                out[(adapter, base)] = reason
    return out


def _by_base(plan) -> dict[tuple[str, str], tuple[str, str | None, str]]:
    """(adapter, scenario id without device) -> (skip, xfail, the adapter's own skip on that device)."""
    out = {}
    adapters = {spec: registry.load(spec) for spec in ADAPTERS}
    for case in plan.cases:
        base = split_device(case.scenario.id)[0] if case.scenario.device != "cpu" else case.scenario.id
        declared = _capability_skip(adapters[case.adapter_spec], case.scenario)
        out[(case.adapter_spec, base)] = (case.skip, case.xfail, declared)
    return out


@pytest.mark.parametrize("profile", ["quick", "standard", "full"])
def test_the_cuda_plan_is_the_cpu_plan_plus_the_declared_differences(profile):
    cpu = _by_base(make_plan(Selection(adapters=ADAPTERS, profile=profile, device="cpu")))
    cuda = _by_base(make_plan(Selection(adapters=ADAPTERS, profile=profile, device="cuda")))
    assert cpu.keys() == cuda.keys()
    cpu_only, cuda_only = _device_entries("cpu"), _device_entries("cuda")
    wrong = []
    for key, (skip, xfail, declared) in cpu.items():
        if skip and skip == declared and cuda[key][2] != declared:
            skip = cuda[key][2]  # the adapter's own device rule (declared in its unavailable())
        expected = (skip, xfail)
        if not skip and key in cpu_only and xfail == cpu_only[key]:
            expected = ("", None)  # a CPU-only failure: judged like any case on CUDA
        if not skip and key in cuda_only and expected[1] is None:
            expected = ("", cuda_only[key])
        if not expected[0] and expected[1] is not None and ends_world(expected[1]):
            expected = (CUDA_ENDS_WORLD.format(reason=expected[1]), None)
        if cuda[key][:2] != expected:
            wrong.append(f"{CASE_SEPARATOR.join(key)}: CPU {cpu[key][:2]}, CUDA {cuda[key][:2]}, expected {expected}")
    assert not wrong, f"{len(wrong)} cases differ beyond the declared differences:\n" + "\n".join(wrong[:20])


def test_the_declared_differences_are_there():
    """The rule is not vacuous: there are CPU-only skips and ends-world entries, and torch
    DDP's known failures (upstream bugs, not CPU artefacts) stay expected on CUDA."""
    cuda = make_plan(Selection(adapters=ADAPTERS, profile="full", device="cuda"))
    by_id = {c.id: c for c in cuda.cases}
    assert by_id["torch-ddp|ddp/buffer-order/buffer-order/w2/fp32/cuda"].xfail.startswith("positional buffer broadcast")
    assert "pytorch/pytorch#128949" in by_id["torch-ddp|ddp/unused-without-fuf/branches/w2/fp32/cuda"].xfail
    ends = by_id["torch-ddp|ddp/rank-uses-no-param/branches/w2/fp32/cuda"]
    assert ends.xfail is None and ends.skip.startswith("skipped on CUDA: this case ends the world")
    assert "pytorch/pytorch#40566" in ends.skip
    assert not cuda.unmatched
    # torch DDP's reduce_dtype needs CUDA events: a CPU-only skip (the adapter's), run on CUDA
    cpu = make_plan(Selection(adapters=ADAPTERS, profile="full", device="cpu"))
    reduce_cpu = [c for c in cpu.cases if c.id.startswith("torch-ddp|ddp/reduce-bf16/")]
    assert reduce_cpu and all("CUDA events" in (c.skip or "") for c in reduce_cpu)
    assert not any(by_id[c.id + "/cuda"].skip for c in reduce_cpu)


def test_torch_ddp_stays_torchs_when_its_name_is_swapped(monkeypatch):
    """A process that swaps refimpl's DDP in for `torch.nn.parallel.DistributedDataParallel`
    (a drop-in swap; tests/refimpl/test_torch_ddp_suite.py did so at import, and a long-lived
    test worker then planned refimpl-ddp's reduce_dtype cases as torch DDP's CPU skips) still
    plans torch-ddp as torch's DDP and refimpl-ddp as refimpl's."""
    import torch

    import refimpl
    from conformance.adapters import ddp_like

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", refimpl.DistributedDataParallel)
    assert ddp_like.torch_ddp().cls is torch.nn.parallel.distributed.DistributedDataParallel
    (scenario,) = [s for s in _full_ddp() if s.id == "ddp/reduce-bf16/mlp/w2/fp32"]
    assert ddp_like.refimpl_ddp().unavailable(scenario) is None
    assert "CUDA events" in ddp_like.torch_ddp().unavailable(scenario)


def _full_ddp():
    from conformance.catalogue import select

    return select(area="ddp", profile="full")


def test_an_entry_for_one_device_matches_only_there(tmp_path):
    xfails = tmp_path / "mine.txt"
    xfails.write_text("refimpl-ddp|ddp/no-sync/mlp/w2/fp32/cuda  # only on GPUs\n"
                      "refimpl-ddp|ddp/static-graph/mlp/w2/fp32/cpu  # only on the CPU\n")
    for device, expect in (("cpu", {"ddp/static-graph/mlp/w2/fp32": "only on the CPU"}),
                           ("cuda", {"ddp/no-sync/mlp/w2/fp32/cuda": "only on GPUs"})):
        plan = make_plan(Selection(adapters=("refimpl-ddp",), profile="quick", device=device,
                                   xfail_files=(str(xfails),), builtin_xfails=False))
        got = {c.scenario.id: c.xfail for c in plan.cases if c.xfail}
        assert got == expect, device
        assert not plan.unmatched, plan.unmatched
