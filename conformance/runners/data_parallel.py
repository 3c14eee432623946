"""The `data_parallel` area's driver: single-process, so `check` runs in the coordinator.

For every step: the implementation's `data_parallel(model, inputs, devices, devices[0], dim)`
forward and a backward through its output, against a plain forward/backward of an identical
copy on the full batch. Compared, in order, bitwise or within the scenario's tolerance:
the output (structure and every leaf), every parameter's gradient of the *original*
module (None stays None: frozen parameters), then — after the same optimizer step on both —
every parameter and buffer (buffers must be untouched: eval-mode BatchNorm, no buffers
written by replicas). With no optimizer the steps accumulate into `.grad`: the second call's
gradients must add to the first's.
"""

from __future__ import annotations

import copy
import time

import torch

from conformance.compare import ConformanceError, Mismatch, compare_dicts, failure_message
from conformance.contract import Checked, repro_command
from conformance.failure import ImplementationRaised
from conformance.fixtures.data import make_optimizer
from conformance.fixtures.dp_models import (
    DP_MODELS,
    build,
    flatten_output,
    make_batch,
    structure,
    total_loss,
)
from conformance.spec import Scenario


def run(payload, ctx):  # noqa: ARG001 - the area needs no rank processes
    raise RuntimeError("the data_parallel area is single-process: its check runs in the coordinator")


def _grads(module) -> dict:
    return {n: (None if p.grad is None else p.grad.detach().to("cpu", copy=True))
            for n, p in module.named_parameters()}


def _params(module) -> dict:
    return {n: p.detach().to("cpu", copy=True) for n, p in module.named_parameters()}


def _buffers(module) -> dict:
    return {n: b.detach().to("cpu", copy=True) for n, b in module.named_buffers()}


def _outputs(out) -> dict:
    return {k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
            for k, v in flatten_output(out).items()}


def check(scenario: Scenario, adapter_spec: str, session=None) -> Checked:
    from conformance.adapters import registry

    adapter = registry.load(adapter_spec)
    tol = scenario.tolerance
    repro = repro_command(scenario, adapter_spec)
    spec = DP_MODELS[scenario.model]
    device_list = adapter.devices(scenario) if hasattr(adapter, "devices") else ["cpu"] * scenario.world_size
    first = device_list[0]
    home = torch.device("cpu") if scenario.device == "cpu" else torch.device("cuda", first if isinstance(first, int) else torch.device(first).index or 0)
    batch = sum(scenario.shard_sizes) if scenario.shard_sizes else 4 * scenario.world_size

    torch.manual_seed(scenario.seed)
    model = build(scenario.model, scenario.kwargs(), seed=scenario.seed, dtype=scenario.dtype, device=home,
                  exact=scenario.exact_data)
    oracle = copy.deepcopy(model)
    opt, opt_oracle = (make_optimizer(scenario.optimizer, [p for p in m.parameters() if p.requires_grad])
                       for m in (model, oracle))
    count, seconds = 0, 0.0

    def fail(step, what, mismatches):
        raise ConformanceError(failure_message(
            scenario_id=scenario.id, adapter=adapter_spec, rank=0, where=f"step {step}", what=what,
            mismatches=mismatches, tol=tol, repro=repro,
        ))

    for step in range(scenario.steps):
        inputs = make_batch(scenario.model, seed=scenario.seed, step=step, batch=batch, dtype=scenario.dtype, device=home)
        expected_out = oracle(*inputs)
        total_loss(expected_out).backward()
        t0 = time.perf_counter()
        try:
            out = adapter.data_parallel(model, inputs, device_list, first, spec.dim)
            total_loss(out).backward()
        except Exception as exc:
            raise ImplementationRaised(
                f"[{scenario.id}] adapter {adapter_spec}: step {step}: {type(exc).__name__}: {exc}\n  repro: {repro}", exc
            ) from exc
        seconds += time.perf_counter() - t0

        if structure(out) != structure(expected_out):
            raise ConformanceError(
                f"[{scenario.id}] adapter {adapter_spec}: step {step}: output structure {structure(out)} "
                f"but the module returns {structure(expected_out)}\n  repro: {repro}"
            )
        expected, actual = _outputs(expected_out), _outputs(out)
        bad = [Mismatch(k, f"non-tensor output {actual[k]!r} but expected {expected[k]!r}")
               for k in expected if not isinstance(expected[k], torch.Tensor) and actual.get(k) != expected[k]]
        bad += compare_dicts({k: v for k, v in expected.items() if isinstance(v, torch.Tensor)},
                             {k: v for k, v in actual.items() if isinstance(v, torch.Tensor)}, tol)
        count += 1
        if bad:
            fail(step, "gathered output differs from the module's output on the full batch", bad)
        bad = compare_dicts(_grads(oracle), _grads(model), tol)
        count += 1
        if bad:
            fail(step, "gradients of the original module differ from a full-batch backward", bad)
        if opt is not None:
            opt.step()
            opt_oracle.step()
            opt.zero_grad(set_to_none=True)
            opt_oracle.zero_grad(set_to_none=True)
        bad = compare_dicts(_params(oracle), _params(model), tol)
        count += 1
        if bad:
            fail(step, "parameters after the optimizer step differ", bad)
        bad = compare_dicts(_buffers(oracle), _buffers(model), tol)
        count += 1
        if bad:
            fail(step, "buffers differ from the full-batch module's (replicas must not change them)", bad)
    return Checked(count, details={"seconds": seconds, "devices": [str(d) for d in device_list]})
