"""The `data_parallel` area: single-process, so its task (`run`) runs in the coordinator and compares as it goes.

For every step: the implementation's `data_parallel(model, inputs, devices, devices[0], dim)`
forward and a backward through its output. Compared, in order: the output (structure and
every leaf), every parameter's gradient of the *original* module (None stays None: frozen
parameters), then, after the same optimizer step, every parameter and buffer (buffers must be
untouched: eval-mode BatchNorm, no buffers written by replicas). With no optimizer the steps
accumulate into `.grad`: the second call's gradients must add to the first's.

Two oracles judge each value (issue 25). First, re-anchored and replica by replica
(`conformance.oracle.replica_oracle`): from the implementation's own parameters and buffers, every
replica of its split replayed, their gradients' sum an envelope of summation orders, the
optimizer stepped on the implementation's judged gradients: the scenario's rule, bitwise or
bitwise to a summation order. Then the contract's reference, a plain forward/backward of an
identical copy on the full batch trained straight through from the seeds, under the rule's
`straight_through` band (bitwise where the data keep every sum exact).

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

from conformance.judge.compare import ConformanceError, Mismatch, compare_dicts, failure_message
from conformance.judge.contract import Checked, repro_command
from conformance.judge.failure import ImplementationRaised
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
from conformance.oracle import replica_oracle
from conformance.oracle.data_parallel import oracle_forward
from conformance.oracle.envelope import Envelope
from conformance.runners.recording_tap import tap
from conformance.spec import EXACT, Scenario

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


def _rules(scenario: Scenario):
    """(the re-anchored rule, the straight-through check's): the scenario's rule judges every step
    replica by replica; the full-batch oracle trained straight through keeps its old band (the
    scenario's `straight_through`), bitwise where the scenario's data keep every sum exact."""
    tol = scenario.tolerance
    band = tol.straight_through or (tol if tol.kind in ("band", "norm") else EXACT)
    return tol, band


def _load(module, params: dict, buffers: dict) -> None:
    """Re-anchor: the module continues from the implementation's (judged) parameters and buffers."""
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(params[n])
        for n, b in module.named_buffers():
            b.copy_(buffers[n])


def check(scenario: Scenario, adapter_spec: str) -> Checked:
    return _Check(scenario, adapter_spec).run()


class _Check:
    """One data_parallel case, step by step, in the phases of a training step:

        1. construction      the implementation's model, the full-batch oracle (trained straight
                             through) and the anchored copy, their optimizers, the splits
        2. oracle forward    the full batch on the oracle; every replica of each candidate split
                             on the anchored copy (the implementation's state)
        3. the call          the implementation's `data_parallel` and the backward of its output
        4. judge             outputs, parameter and input gradients against the replicas' replay
                             (re-anchored rule), then the full-batch oracle under its band
        5. step              the three optimizers; parameters and buffers judged the same way
    """

    # -- 1. construction --------------------------------------------------------------------
    def __init__(self, scenario: Scenario, adapter_spec: str):
        from conformance.adapters import registry

        self.scenario, self.adapter_spec = scenario, adapter_spec
        self.adapter = adapter = registry.load(adapter_spec)
        self.tol, self.band = _rules(scenario)
        self.repro = repro_command(scenario, adapter_spec)
        self.spec = DP_MODELS[scenario.model]
        self.device_list = adapter.devices(scenario) if hasattr(adapter, "devices") else ["cpu"] * scenario.world_size
        first = self.first = self.device_list[0]
        self.home = torch.device("cpu") if scenario.device == "cpu" else torch.device(
            "cuda", first if isinstance(first, int) else torch.device(first).index or 0)
        self.batch = sum(scenario.shard_sizes) if scenario.shard_sizes else 4 * scenario.world_size
        self.sizes, self.split_rule = replica_oracle.splits(adapter, self.batch, scenario.world_size)

        torch.manual_seed(scenario.seed)
        model_kwargs = {k: v for k, v in scenario.kwargs().items() if k not in SWITCHES}
        self.model = build(scenario.model, model_kwargs, seed=scenario.seed, dtype=scenario.dtype, device=self.home,
                           exact=scenario.exact_data)
        self.oracle = copy.deepcopy(self.model)  # the full batch, trained straight through: the second check
        self.anchored = copy.deepcopy(self.model)  # replica by replica, from the implementation's state each step
        self.opt, self.opt_oracle, self.opt_anchored = (
            make_optimizer(scenario.optimizer, [p for p in m.parameters() if p.requires_grad])
            for m in (self.model, self.oracle, self.anchored))
        self.count, self.seconds, self.envelopes, self.widest = 0, 0.0, 0, (0.0, 0.0)
        self.kw = scenario.kwargs()
        self.input_grad = bool(self.kw.get("input_grad"))

    def fail(self, step, what, mismatches, rule=None):
        raise ConformanceError(failure_message(
            scenario_id=self.scenario.id, adapter=self.adapter_spec, rank=0, where=f"step {step}", what=what,
            mismatches=mismatches, tol=self.tol if rule is None else rule, repro=self.repro,
        ))

    def judge(self, step, what, expected, actual, straight=None):
        """The re-anchored rule first, then the full-batch oracle under its band."""
        for value in expected.values():
            if isinstance(value, Envelope):
                self.envelopes += 1
                self.widest = tuple(max(a, b) for a, b in zip(self.widest, value.spread(), strict=True))
        bad = compare_dicts(expected, actual, self.tol)
        self.count += 1
        if bad:
            self.fail(step, what, bad)
        if straight is not None:
            bad = compare_dicts(straight, actual, self.band)
            if bad:
                self.fail(step, f"straight-through check (the full-batch oracle trained from the seeds; the replica-by-"
                                f"replica check passed): {what}", bad, self.band)

    def _no_grad_call(self, step: int | None = None) -> None:
        self.count += _check_no_grad(self.scenario, self.adapter, self.model, self.oracle, self.device_list, self.home,
                                     self.batch, self.fail, self.sizes, step=step)

    def run(self) -> Checked:
        scenario, kw = self.scenario, self.kw
        if kw.get("no_grad_first"):  # an evaluation call before any training call
            self._no_grad_call(step=scenario.steps + 1)
        for step in range(scenario.steps):
            if kw.get("eval_last") and step == scenario.steps - 1:
                for m in (self.model, self.oracle, self.anchored):
                    m.eval()
            _load(self.anchored, _params(self.model), _buffers(self.model))
            inputs, module_kwargs, expected_out, passes, split_inputs, oracle_inputs = self._oracle_forward(step)
            before = _grads(self.model)
            out, loss = self._call(step, inputs, module_kwargs)
            grads_now = self._judge_backward(step, out, loss, expected_out, passes, before)
            if self.input_grad:
                self._judge_input_grads(step, inputs, split_inputs, oracle_inputs)
            self._step(grads_now)
            self._judge_state(step, passes)
        if kw.get("no_grad"):
            self._no_grad_call()
        return self._checked()

    # -- 2. oracle forward ------------------------------------------------------------------
    def _oracle_forward(self, step: int):
        """The step's inputs (the implementation's copy), the full-batch oracle's output (and
        backward), and every candidate split's replicas replayed on the anchored copy."""
        scenario, home, spec, kw = self.scenario, self.home, self.spec, self.kw
        drawn = make_batch(scenario.model, seed=scenario.seed, step=step, batch=self.batch, dtype=scenario.dtype,
                           device=home)
        module_kwargs = make_module_kwargs(scenario.model, seed=scenario.seed, step=step, batch=self.batch,
                                           dtype=scenario.dtype, device=home)
        inputs, oracle_inputs = _clone_inputs(drawn, self.input_grad), _clone_inputs(drawn, self.input_grad)
        with ambient(kw, home):
            expected_out = oracle_forward(self.oracle, oracle_inputs, spec, scenario.world_size, module_kwargs)
        total_loss(expected_out).backward()
        passes, split_inputs = [], []
        for split in self.sizes:  # every replica of each candidate split, from the implementation's state
            split_inputs.append(_clone_inputs(drawn, self.input_grad))
            with ambient(kw, home):
                passes.append(replica_oracle.replica_pass(self.anchored, split_inputs[-1], module_kwargs, split, spec.dim))
        return inputs, module_kwargs, expected_out, passes, split_inputs, oracle_inputs

    # -- 3. the call ------------------------------------------------------------------------
    def _call(self, step: int, inputs, module_kwargs):
        """The implementation's forward and the backward of its output; its error is the finding."""
        t0 = time.perf_counter()
        try:
            with ambient(self.kw, self.home):
                out = call_adapter(self.adapter, self.model, inputs, self.device_list, self.first, self.spec.dim,
                                   module_kwargs)
            loss = total_loss(out)
            loss.backward()
        except Exception as exc:
            raise ImplementationRaised(
                f"[{self.scenario.id}] adapter {self.adapter_spec}: step {step}: {type(exc).__name__}: {exc}\n"
                f"  repro: {self.repro}", exc
            ) from exc
        self.seconds += time.perf_counter() - t0
        return out, loss

    # -- 4. judge ---------------------------------------------------------------------------
    def _judge_backward(self, step: int, out, loss, expected_out, passes, before) -> dict:
        """The gathered output and the original module's gradients; returns those gradients."""
        if structure(out) != structure(expected_out):
            raise ConformanceError(
                f"[{self.scenario.id}] adapter {self.adapter_spec}: step {step}: output structure {structure(out)} "
                f"but the module returns {structure(expected_out)}\n  repro: {self.repro}"
            )
        expected, actual = _outputs(expected_out), _outputs(out)
        tap("backward", step, "loss", {"loss": loss})  # for `--record` (conformance.recording); no-op otherwise
        tap("backward", step, "output", {k: v for k, v in actual.items() if isinstance(v, torch.Tensor)})
        grads_now = _grads(self.model)
        tap("backward", step, "grad", grads_now)
        bad = [Mismatch(k, f"non-tensor output {actual[k]!r} but expected {expected[k]!r}")
               for k in expected if not isinstance(expected[k], torch.Tensor) and actual.get(k) != expected[k]]
        if bad:
            self.fail(step, "gathered output differs from the module's output on the full batch", bad)
        tensors = [k for k, v in expected.items() if isinstance(v, torch.Tensor)]
        replayed = {k: replica_oracle.union([p.output[k].detach() for p in passes]) for k in tensors}
        self.judge(step, "gathered output differs from the module's output on the replicas' chunks",
                   replayed, {k: actual[k] for k in tensors}, {k: expected[k] for k in tensors})
        summed = [replica_oracle.summed(p.grads, self.tol) for p in passes]
        wanted = {n: replica_oracle.union([replica_oracle.accumulate(s[n], before[n]) for s in summed])
                  for n in grads_now}
        self.judge(step, "gradients of the original module differ from the sum of the replicas' gradients",
                   wanted, grads_now, _grads(self.oracle))
        return grads_now

    def _judge_input_grads(self, step: int, inputs, split_inputs, oracle_inputs) -> None:
        grads = lambda obj: {k: (None if t.grad is None else t.grad.detach().cpu()) for k, t in _leaves(obj).items()}  # noqa: E731
        tap("backward", step, "input-grad", grads(inputs))
        per_split = [grads(i) for i in split_inputs]
        self.judge(step, "gradients of the inputs differ (scatter must pass the chunks' gradients back)",
                   {k: replica_oracle.union([g[k] for g in per_split]) for k in per_split[0]},
                   grads(inputs), grads(oracle_inputs))

    # -- 5. step ----------------------------------------------------------------------------
    def _step(self, grads_now: dict) -> None:
        if self.opt is None:
            return
        self.opt.step()
        self.opt_oracle.step()
        with torch.no_grad():  # re-anchored: the same optimizer on the implementation's judged gradients
            for n, p in self.anchored.named_parameters():
                p.grad = None if grads_now[n] is None else grads_now[n].clone()
        self.opt_anchored.step()
        for o in (self.opt, self.opt_oracle, self.opt_anchored):
            o.zero_grad(set_to_none=True)

    def _judge_state(self, step: int, passes) -> None:
        params_now, buffers_now = _params(self.model), _buffers(self.model)
        tap("step", step, "param", params_now)
        tap("step", step, "buffer", buffers_now)
        self.judge(step, "parameters after the optimizer step differ", _params(self.anchored), params_now,
                   _params(self.oracle))
        self.judge(step, "buffers differ (replicas must not change them; replica 0's running statistics are kept)",
                   {n: replica_oracle.union([p.buffers[n] for p in passes]) for n in buffers_now}, buffers_now,
                   _buffers(self.oracle))

    def _checked(self) -> Checked:
        tol, band, sizes = self.tol, self.band, self.sizes
        summary = {"rule": tol.describe(), "kind": tol.kind, "reason": tol.reason,
                   "steps": f"re-anchored on the implementation's state, replica by replica ({self.split_rule} split "
                            f"{' or '.join(str(list(s)) for s in sizes)})",
                   "envelopes": self.envelopes, "largest_bound_abs": self.widest[0], "largest_bound_u": self.widest[1],
                   "straight_through": f"within {band.describe()} (the full batch, trained from the seeds)"}
        return Checked(self.count, details={"seconds": self.seconds, "devices": [str(d) for d in self.device_list],
                                            "oracle": summary})


def _check_no_grad(scenario, adapter, model, oracle, device_list, home, batch, fail, sizes,
                   step: int | None = None) -> int:
    """A call under torch.no_grad(): the same output, no graph, gradients left as they were."""
    spec = DP_MODELS[scenario.model]
    tol, band = _rules(scenario)
    step = scenario.steps if step is None else step
    inputs = make_batch(scenario.model, seed=scenario.seed, step=step, batch=batch, dtype=scenario.dtype, device=home)
    module_kwargs = make_module_kwargs(scenario.model, seed=scenario.seed, step=step, batch=batch,
                                       dtype=scenario.dtype, device=home)
    before = _grads(model)
    with torch.no_grad(), ambient(scenario.kwargs(), home):
        expected_out = oracle_forward(oracle, inputs, spec, scenario.world_size, module_kwargs)
        state = copy.deepcopy(model)  # replayed from the implementation's state, leaving it untouched
        passes = [replica_oracle.replica_pass(state, inputs, module_kwargs, s, spec.dim, backward=False) for s in sizes]
        try:
            out = call_adapter(adapter, model, inputs, device_list, device_list[0], spec.dim, module_kwargs)
        except Exception as exc:  # noqa: BLE001 - the implementation's error is the finding
            fail(step, f"a call under torch.no_grad() raised {type(exc).__name__}: {exc}", [])
    expected, actual = _outputs(expected_out), _outputs(out)
    tensors = [k for k, v in expected.items() if isinstance(v, torch.Tensor)]
    replayed = {k: replica_oracle.union([p.output[k] for p in passes]) for k in tensors}
    bad = compare_dicts(replayed, {k: actual[k] for k in tensors}, tol)
    if bad:
        fail(step, "under torch.no_grad() the gathered output differs from the replicas' outputs", bad)
    bad = compare_dicts({k: expected[k] for k in tensors}, {k: actual[k] for k in tensors}, band)
    if bad:
        fail(step, "straight-through check: under torch.no_grad() the gathered output differs from the module's", bad,
             band)
    graph = [k for k, v in flatten_output(out).items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if graph:
        fail(step, f"under torch.no_grad() the output {graph[0]} requires grad (a graph was built)", [])
    bad = compare_dicts(before, _grads(model), EXACT)
    if bad:
        fail(step, "a call under torch.no_grad() changed the gradients", bad, EXACT)
    return 3
