"""The `data_parallel` area: single-process, so its task (`run`) runs in the coordinator and compares as it goes.

For every step: the implementation's `data_parallel(model, inputs, devices, devices[0], dim)`
forward and a backward through its output, against a plain forward/backward of an identical
copy on the full batch. Compared, in order, bitwise or within the scenario's tolerance:
the output (structure and every leaf), every parameter's gradient of the *original*
module (None stays None: frozen parameters), then — after the same optimizer step on both —
every parameter and buffer (buffers must be untouched: eval-mode BatchNorm, no buffers
written by replicas). With no optimizer the steps accumulate into `.grad`: the second call's
gradients must add to the first's.

Scenario switches (model kwargs, `docs/contracts/data_parallel.md`): `input_grad` makes the
floating-point inputs require grad and compares their gradients (scatter is differentiable);
`no_grad` adds a last call under `torch.no_grad()`, whose output must match and hold no
graph, and which must leave every gradient as it was. Models with `oracle="per-chunk"` are
compared with the module run on each equal chunk in turn (outputs concatenated, 0-dim ones
stacked; running statistics: replica 0's chunk's update).

Issue 30 (ambient state, time, keyword arguments): models with keyword arguments
(`DPModel.kwargs`) pass them as `module_kwargs` (the adapter's optional sixth parameter) and to
the oracle; the switch `autocast` runs every forward, the oracle's and the implementation's,
under `torch.autocast(<device>, bfloat16)` (the replicas run in worker threads: they must see
it too); `no_grad_first` makes the first call one under `torch.no_grad()` (checked like
`no_grad`) before the training calls (state kept from an earlier call must not leak into a
later one); `eval_last` switches the module (and the oracle) to eval mode before the last step.
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch

from conformance.compare import ConformanceError, Mismatch, compare_dicts, failure_message
from conformance.contract import Checked, repro_command
from conformance.failure import ImplementationRaised
from conformance.models.data import make_optimizer
from conformance.models.data_parallel import (
    DP_MODELS,
    build,
    flatten_output,
    make_batch,
    make_module_kwargs,
    map_leaves,
    structure,
    total_loss,
)
from conformance.runners.recording_tap import tap
from conformance.spec import Scenario

SWITCHES = ("input_grad", "no_grad", "autocast", "no_grad_first", "eval_last")  # scenario switches, not model arguments


def run(payload, ctx=None) -> Checked:  # noqa: ARG001 - in-process: no rank context
    """The area's task, run in the coordinator (one process drives every replica).

    The oracle steps beside the implementation, so comparing happens here as it runs (a wrong
    step is reported at that step); the record this returns is already the verdict."""
    scenario, adapter_spec = payload
    return check(scenario, adapter_spec)


def judge(scenario: Scenario, adapter_spec: str, records: dict[int, Checked]) -> Checked:  # noqa: ARG001
    """`run` compared as it went: its `Checked` is the verdict."""
    return records[0]


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


def _leaves(obj, path: str = "input") -> dict:
    """Every tensor of a nested input by path (namedtuples, lists, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_leaves(v, f"{path}[{k!r}]"))
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            out.update(_leaves(v, f"{path}[{i}]"))
    return out


def _clone_inputs(obj, grad: bool):
    """A fresh copy of the inputs; floating-point tensors require grad when `grad`."""
    def clone(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        t = leaf.detach().clone()
        return t.requires_grad_() if grad and t.is_floating_point() else t

    return map_leaves(obj, clone)


def oracle_forward(oracle, inputs: tuple, spec, replicas: int, module_kwargs: dict | None = None):
    """The module on the full batch, or ("per-chunk") on each equal chunk in turn, gathered."""
    if spec.oracle != "per-chunk":
        return oracle(*inputs, **(module_kwargs or {}))
    chunks = [tuple(t.chunk(replicas, spec.dim)[j] for t in inputs) for j in range(replicas)]
    outs = [oracle(*chunks[0])]  # replica 0's buffer updates are the ones the original keeps
    for args in chunks[1:]:  # the others update copies of the buffers, thrown away
        copies = {n: b.clone() for n, b in oracle.named_buffers()}
        outs.append(torch.func.functional_call(oracle, copies, args))
    if all(o.dim() == 0 for o in outs):
        return torch.stack(outs)
    return torch.cat(outs, spec.dim)


# -- issue 30: keyword arguments and ambient state ----------------------------------------------
def call_adapter(adapter, model, inputs, devices, output_device, dim, module_kwargs: dict):
    """The protocol call; `module_kwargs` (optional sixth parameter) only when the model has some."""
    if module_kwargs:
        return adapter.data_parallel(model, inputs, devices, output_device, dim, module_kwargs=module_kwargs)
    return adapter.data_parallel(model, inputs, devices, output_device, dim)


def ambient(kw: dict, home: torch.device):
    """The state every forward of the step runs in (`autocast` switch: bfloat16 autocast)."""
    if kw.get("autocast"):
        return torch.autocast(home.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def check(scenario: Scenario, adapter_spec: str) -> Checked:
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
    model_kwargs = {k: v for k, v in scenario.kwargs().items() if k not in SWITCHES}
    model = build(scenario.model, model_kwargs, seed=scenario.seed, dtype=scenario.dtype, device=home,
                  exact=scenario.exact_data)
    oracle = copy.deepcopy(model)
    opt, opt_oracle = (make_optimizer(scenario.optimizer, [p for p in m.parameters() if p.requires_grad])
                       for m in (model, oracle))
    count, seconds = 0, 0.0
    kw = scenario.kwargs()
    input_grad = bool(kw.get("input_grad"))

    def fail(step, what, mismatches):
        raise ConformanceError(failure_message(
            scenario_id=scenario.id, adapter=adapter_spec, rank=0, where=f"step {step}", what=what,
            mismatches=mismatches, tol=tol, repro=repro,
        ))

    if kw.get("no_grad_first"):  # an evaluation call before any training call
        count += _check_no_grad(scenario, adapter, model, oracle, device_list, home, batch, fail, step=scenario.steps + 1)
    for step in range(scenario.steps):
        if kw.get("eval_last") and step == scenario.steps - 1:
            model.eval()
            oracle.eval()
        drawn = make_batch(scenario.model, seed=scenario.seed, step=step, batch=batch, dtype=scenario.dtype, device=home)
        module_kwargs = make_module_kwargs(scenario.model, seed=scenario.seed, step=step, batch=batch,
                                           dtype=scenario.dtype, device=home)
        inputs, oracle_inputs = _clone_inputs(drawn, input_grad), _clone_inputs(drawn, input_grad)
        with ambient(kw, home):
            expected_out = oracle_forward(oracle, oracle_inputs, spec, scenario.world_size, module_kwargs)
        total_loss(expected_out).backward()
        t0 = time.perf_counter()
        try:
            with ambient(kw, home):
                out = call_adapter(adapter, model, inputs, device_list, first, spec.dim, module_kwargs)
            loss = total_loss(out)
            loss.backward()
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
        tap("backward", step, "loss", {"loss": loss})  # for `--record` (conformance.recording); no-op otherwise
        tap("backward", step, "output", {k: v for k, v in actual.items() if isinstance(v, torch.Tensor)})
        grads_now = _grads(model)
        tap("backward", step, "grad", grads_now)
        bad = [Mismatch(k, f"non-tensor output {actual[k]!r} but expected {expected[k]!r}")
               for k in expected if not isinstance(expected[k], torch.Tensor) and actual.get(k) != expected[k]]
        bad += compare_dicts({k: v for k, v in expected.items() if isinstance(v, torch.Tensor)},
                             {k: v for k, v in actual.items() if isinstance(v, torch.Tensor)}, tol)
        count += 1
        if bad:
            fail(step, "gathered output differs from the module's output on the full batch", bad)
        bad = compare_dicts(_grads(oracle), grads_now, tol)
        count += 1
        if bad:
            fail(step, "gradients of the original module differ from a full-batch backward", bad)
        if input_grad:
            grads = lambda obj: {k: (None if t.grad is None else t.grad.detach().cpu()) for k, t in _leaves(obj).items()}  # noqa: E731
            tap("backward", step, "input-grad", grads(inputs))
            bad = compare_dicts(grads(oracle_inputs), grads(inputs), tol)
            count += 1
            if bad:
                fail(step, "gradients of the inputs differ from a full-batch backward (scatter must pass them back)", bad)
        if opt is not None:
            opt.step()
            opt_oracle.step()
            opt.zero_grad(set_to_none=True)
            opt_oracle.zero_grad(set_to_none=True)
        params_now, buffers_now = _params(model), _buffers(model)
        tap("step", step, "param", params_now)
        tap("step", step, "buffer", buffers_now)
        bad = compare_dicts(_params(oracle), params_now, tol)
        count += 1
        if bad:
            fail(step, "parameters after the optimizer step differ", bad)
        bad = compare_dicts(_buffers(oracle), buffers_now, tol)
        count += 1
        if bad:
            fail(step, "buffers differ from the full-batch module's (replicas must not change them)", bad)
    if kw.get("no_grad"):
        count += _check_no_grad(scenario, adapter, model, oracle, device_list, home, batch, fail)
    return Checked(count, details={"seconds": seconds, "devices": [str(d) for d in device_list]})


def _check_no_grad(scenario, adapter, model, oracle, device_list, home, batch, fail, step: int | None = None) -> int:
    """A call under torch.no_grad(): the same output, no graph, gradients left as they were."""
    spec, tol = DP_MODELS[scenario.model], scenario.tolerance
    step = scenario.steps if step is None else step
    inputs = make_batch(scenario.model, seed=scenario.seed, step=step, batch=batch, dtype=scenario.dtype, device=home)
    module_kwargs = make_module_kwargs(scenario.model, seed=scenario.seed, step=step, batch=batch,
                                       dtype=scenario.dtype, device=home)
    before = _grads(model)
    with torch.no_grad(), ambient(scenario.kwargs(), home):
        expected_out = oracle_forward(oracle, inputs, spec, scenario.world_size, module_kwargs)
        try:
            out = call_adapter(adapter, model, inputs, device_list, device_list[0], spec.dim, module_kwargs)
        except Exception as exc:  # noqa: BLE001 - the implementation's error is the finding
            fail(step, f"a call under torch.no_grad() raised {type(exc).__name__}: {exc}", [])
    expected, actual = _outputs(expected_out), _outputs(out)
    bad = compare_dicts({k: v for k, v in expected.items() if isinstance(v, torch.Tensor)},
                        {k: v for k, v in actual.items() if isinstance(v, torch.Tensor)}, tol)
    if bad:
        fail(step, "under torch.no_grad() the gathered output differs from the module's", bad)
    graph = [k for k, v in flatten_output(out).items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if graph:
        fail(step, f"under torch.no_grad() the output {graph[0]} requires grad (a graph was built)", [])
    bad = compare_dicts(before, _grads(model), tol)
    if bad:
        fail(step, "a call under torch.no_grad() changed the gradients", bad)
    return 3
