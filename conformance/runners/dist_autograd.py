"""The `dist_autograd` area's driver: distributed autograd over RPC on the warm rank pools.

Rank side (`run`): every rank starts RPC once (`ctx.ensure_rpc()`, workers `worker<rank>`);
ranks other than 0 return at once and their RPC threads keep serving. Rank 0 opens a context,
runs the scenario's composition (`models.dist_autograd.COMPOSITIONS[scenario.model]`) through the
adapter, runs the backward pass(es) and records, after every pass, the gradients of the
context on *every* worker (by name: `x@worker0` for worker 0's leaves, `w2@worker2` for a
parameter owned by worker 2; tensors in a context that are none of these are recorded as
unnamed). After the context exits it polls every worker's debug info until no context and no
backward pass is left (cleanup may be asynchronous). Nothing is judged on the ranks; any
exception is recorded, so the pool stays healthy.

Coordinator side (`judge`, worker 0's record): the oracle is plain local autograd over the same composition
(`mode="local"`: every call a Python call, one process), `torch.autograd.grad` from the roots;
after the k-th of k retained passes it is k times that. The record is compared pass by pass.
The `remote-error` scenario (and a generated row with a failing backward: its last worker reached,
`dist_autograd_composed.fail_node`) instead requires the backward to raise on the caller with
"Error on Node 2" (the worker whose backward failed; torch prefixes one "Error on Node N: " per
hop back, so the innermost one counts) and the original message, no context left
behind anywhere, and a following backward in a new context to be right (a generated row's
next context runs its own composition without the error: `dist_autograd_composed.after_failure`).
A generated row with two contexts runs its composition again in a second context once the first
has exited: each must hold its own passes' gradients, never the first's added in. `contexts-meet`
(A18) has a second caller, worker 1 (dist_autograd_meet.py): its context's id must differ from
worker 0's, and each context is compared with local autograd over its own caller's leaves.
The readers every worker runs (gradients by name, debug info, the cleanup wait) are in
dist_autograd_workers.py.
"""

from __future__ import annotations

import re
import time
import traceback

import torch

from conformance.adapters import registry
from conformance.judge.compare import ConformanceError, Mismatch, compare_dicts, failure_message
from conformance.judge.contract import Checked, repro_command
from conformance.models import dist_autograd as fns
from conformance.models import dist_autograd_composed as composed
from conformance.oracle.dist_autograd import oracle
from conformance.runners.dist_autograd_meet import run_meet
from conformance.runners.dist_autograd_workers import (
    CLEANUP_QUIET_S,
    _all_grads,
    _debug_infos,
    _wait_clean,
    fetch_debug_info,
    fetch_grads,
)
from conformance.spec import Scenario
from refimpl import _torch_compat as compat

fns.use_loader(registry.load)  # [Note: an adapter by its mode] (conformance/models/dist_autograd.py)

ERROR_TEXT = "Simulate error on backward pass"


# -- on the workers: gradients by name, debug info, cleanup (dist_autograd_workers.py) ------------
def _one_context(adapter, mode, scenario: Scenario, kind: str, passes: int) -> dict:
    seed = scenario.seed
    leaves = composed.leaves_of(scenario, kind, seed)
    rec = {"passes": [], "error": None, "dot_grad": [], "shared": []}
    fns.HOOK_CALLS[0] = 0
    before = _debug_infos(mode, scenario.world_size)  # contexts an earlier case left (see _wait_clean)
    with adapter.context() as context_id:
        roots = composed.composition_of(scenario, kind)(mode, seed, leaves)
        for i in range(passes):
            try:
                adapter.backward(context_id, roots, retain_graph=i < passes - 1)
            except Exception as exc:  # noqa: BLE001 - judged by the coordinator
                rec["error"] = f"{type(exc).__name__}: {exc}"
                break
            rec["passes"].append(_all_grads(adapter, mode, seed, context_id, leaves, scenario.world_size))
            rec["shared"].append(_shared_buffers(adapter.get_gradients(context_id), leaves))
    rec["dot_grad"] = [n for n, t in leaves.items() if t.grad is not None]
    rec["hook_calls"] = fns.HOOK_CALLS[0]
    rec["cleanup"] = _wait_clean(mode, scenario.world_size, before)
    return rec


def _shared_buffers(grads: dict, leaves: dict) -> list[list[str]]:
    """Groups of worker0's leaves whose gradients in the context share one buffer (issue 16)."""
    by_storage: dict[int, list[str]] = {}
    for name, leaf in leaves.items():
        g = grads.get(leaf)
        if g is None or g.numel() == 0:
            continue
        key = compat.sparse_values(g).data_ptr() if g.is_sparse else g.untyped_storage().data_ptr()
        by_storage.setdefault(key, []).append(f"{name}@worker0")
    return [names for names in by_storage.values() if len(names) > 1]


def run(payload, ctx) -> dict:
    scenario, mode = payload
    ctx.ensure_rpc()
    if ctx.rank != 0:
        return {"rank": ctx.rank}
    record: dict = {"rank": 0, "crash": None}
    fired_before = _fired_everywhere(mode, scenario.world_size)
    try:
        adapter = fns.adapter_for(mode)
        kind = scenario.model
        passes = composed.passes_of(scenario, kind)
        t0 = time.perf_counter()
        if kind == "contexts-meet":  # two callers (A18): dist_autograd_meet.py
            record["main"] = run_meet(adapter, mode, scenario)
        else:
            record["main"] = _one_context(adapter, mode, scenario, kind, passes)
        if composed.fail_node(scenario) is not None:
            after, after_kind = composed.after_failure(scenario)
            record["after"] = _one_context(adapter, mode, after, after_kind, 1)
        elif composed.contexts_of(scenario) == 2:  # a second context after the first: its own gradients
            record["second"] = _one_context(adapter, mode, scenario, kind, passes)
        record["seconds"] = time.perf_counter() - t0
    except Exception:  # noqa: BLE001 - report, keep the pool healthy
        record["crash"] = traceback.format_exc()
    fired_after = _fired_everywhere(mode, scenario.world_size)
    if fired_before is not None and fired_after is not None:
        record["mutation_fired"] = fired_after - fired_before
    return record


# -- the zoo's known-bad implementations: how often a mutation fired, summed over the workers ----
def fetch_fired(mode: str) -> int | None:
    return getattr(fns.adapter_for(mode), "mutation_fired", None)


def _fired_everywhere(mode: str, world_size: int) -> int | None:
    """Sum of every worker's `mutation_fired` (None for implementations that do not count)."""
    from torch.distributed import rpc

    counts = [rpc.rpc_sync(f"worker{k}", fetch_fired, args=(mode,)) for k in range(world_size)]
    return None if all(c is None for c in counts) else sum(c or 0 for c in counts)


# -- the coordinator -----------------------------------------------------------------------------
def _compare_passes(scenario, adapter_spec, kind, rec, expected_once, repro, label="") -> int:
    tol = scenario.tolerance
    count = 0
    for i, actual in enumerate(rec["passes"]):
        expected = {n: (None if g is None else g * (i + 1)) for n, g in expected_once.items()}
        full_actual = {n: actual.get(n) for n in expected}
        full_actual.update({n: g for n, g in actual.items() if n not in expected})
        layouts = _layout_mismatches(expected, full_actual)
        if layouts:
            raise ConformanceError(
                f"[{scenario.id}] adapter {adapter_spec}: backward pass {i + 1}{label}: gradient layout "
                f"differs from local autograd: {layouts}\n  repro: {repro}")
        bad = compare_dicts(_dense(expected), _dense(full_actual), tol)
        count += 1
        if bad:
            what = f"gradients in the context differ from local autograd over the same composition{label}"
            if i:
                what += f" (pass {i + 1} with retain_graph: gradients must accumulate to {i + 1}x)"
            raise ConformanceError(failure_message(
                scenario_id=scenario.id, adapter=adapter_spec, rank=0, where=f"backward pass {i + 1}{label}",
                what=what, mismatches=bad, tol=tol, repro=repro,
            ))
    shared = [group for groups in rec.get("shared", []) for group in groups]
    if shared:
        raise ConformanceError(
            f"[{scenario.id}] adapter {adapter_spec}: leaves {shared[0]} share one gradient buffer in the "
            f"context (each leaf needs its own: an in-place update of one would change the other)\n  repro: {repro}")
    if kind.startswith("accumulate-hooks") and rec.get("hook_calls") != len(rec["passes"]):
        raise ConformanceError(
            f"[{scenario.id}] adapter {adapter_spec}: the post hook on x's AccumulateGrad node ran "
            f"{rec.get('hook_calls')} times in {len(rec['passes'])} backward pass(es); torch's engine runs "
            f"it once per pass\n  repro: {repro}")
    if rec["dot_grad"]:
        raise ConformanceError(
            f"[{scenario.id}] adapter {adapter_spec}: distributed backward wrote .grad of {rec['dot_grad']} "
            f"(gradients belong in the context only)\n  repro: {repro}")
    if not rec["cleanup"]["clean"]:
        raise ConformanceError(
            f"[{scenario.id}] adapter {adapter_spec}: after the context exited{label} (waited until nothing changed for {CLEANUP_QUIET_S:g} s), "
            f"workers still hold contexts or passes: {rec['cleanup']['left']}\n  repro: {repro}")
    return count + 2


def _judge_meet(scenario, adapter_spec: str, rec: dict, repro: str) -> Checked:
    """The two ids differ, neither side raised, each context holds its own pass's gradients."""
    where = f"[{scenario.id}] adapter {adapter_spec}"
    ids, level = rec["ids"], rec["level"]
    if ids.get(0) is not None and ids.get(0) == ids.get(1):
        raise ConformanceError(
            f"{where}: contexts opened on worker0 and worker1 got the same id {ids[0]} (after "
            f"both had opened as many contexts; last ids before {level['last_ids']}): context ids "
            "must be unique across workers (torch puts the worker id in their top 16 bits), or "
            f"the contexts mix on worker2 where their graphs meet\n  repro: {repro}")
    for who, error in (("worker1's", rec["peer"]["error"]), ("worker0's", rec["error"])):
        if error:
            raise ConformanceError(
                f"{where}: with contexts of worker0 and worker1 open on worker2 at once, {who} "
                f"context raised {error[:2000]}\n  repro: {repro}")
    count = _compare_passes(scenario, adapter_spec, "contexts-meet", rec,
                                   oracle(scenario, "contexts-meet"), repro, " (worker0's context)")
    peer = {"passes": [rec["peer"]["grads"]], "dot_grad": [], "cleanup": {"clean": True}}
    count += _compare_passes(scenario, adapter_spec, "contexts-meet", peer,
                                    oracle(scenario, "contexts-meet", caller=1), repro,
                                    " (worker1's context)")
    return Checked(count + 1, details={"seconds": rec.get("seconds")})


def _layout_mismatches(expected: dict, actual: dict) -> dict[str, str]:
    """{name: "expected L1, got L2"} where a gradient's layout (strided/sparse) is not local autograd's."""
    out = {}
    for name, e in expected.items():
        a = actual.get(name)
        if e is not None and a is not None and e.layout != a.layout:
            out[name] = f"expected {e.layout}, got {a.layout}"
    return out


def _dense(grads: dict) -> dict:
    return {n: (g.to_dense() if g is not None and g.layout != torch.strided else g) for n, g in grads.items()}


def judge(scenario: Scenario, adapter_spec: str, records: dict[int, dict]) -> Checked:
    """Worker 0's record (the caller of every composition) against local autograd."""
    repro = repro_command(scenario, adapter_spec)
    rec = records[0]
    if rec.get("crash"):
        raise ConformanceError(f"[{scenario.id}] adapter {adapter_spec}: rank 0 raised\n{rec['crash']}  repro: {repro}")
    kind = scenario.model
    main = rec["main"]
    if kind == "contexts-meet":
        return _judge_meet(scenario, adapter_spec, main, repro)
    fail_at = composed.fail_node(scenario)
    if fail_at is not None:
        message = main["error"]
        if message is None:
            raise ConformanceError(
                f"[{scenario.id}] adapter {adapter_spec}: the backward should have raised on the caller "
                f"(worker{fail_at}'s backward fails) but returned normally\n  repro: {repro}")
        # refimpl: "Error on Node 2: <message>"; torch wraps once per hop on the way back:
        # "Error on Node 0: Error on Node 1: Error on Node 2: <message>". Both are accepted: the
        # innermost node named must be the failing worker, and the original message must follow.
        nodes = [int(n) for n in re.findall(r"Error on Node (\d+)", message)]
        if not nodes or nodes[-1] != fail_at or ERROR_TEXT not in message.rsplit("Error on Node", 1)[-1]:
            raise ConformanceError(
                f"[{scenario.id}] adapter {adapter_spec}: the error on the caller must name the failing worker "
                f"as 'Error on Node {fail_at}' and carry the original message {ERROR_TEXT!r}; got: {message[:500]}"
                f"\n  repro: {repro}")
        count = _compare_passes(scenario, adapter_spec, kind, main, {}, repro, " (failed pass)")
        after, after_kind = composed.after_failure(scenario)
        count += _compare_passes(scenario, adapter_spec, after_kind, rec["after"], oracle(after, after_kind), repro,
                                 " (next context, after the failed pass)")
        return Checked(count, accepted_error=message.splitlines()[0][:200], details={"seconds": rec.get("seconds")})
    if main["error"]:
        raise ConformanceError(f"[{scenario.id}] adapter {adapter_spec}: backward raised {main['error'][:2000]}\n  repro: {repro}")
    passes = composed.passes_of(scenario, kind)
    if len(main["passes"]) != passes:
        raise ConformanceError(f"[{scenario.id}] adapter {adapter_spec}: {len(main['passes'])} of {passes} passes recorded")
    expected = oracle(scenario, kind)
    count = _compare_passes(scenario, adapter_spec, kind, main, expected, repro)
    if "second" in rec:  # each context holds its own passes' gradients, never the first one's too
        second = rec["second"]
        if second["error"] or len(second["passes"]) != passes:
            raise ConformanceError(f"[{scenario.id}] adapter {adapter_spec}: the second context's backward "
                                   f"{'raised ' + second['error'][:2000] if second['error'] else 'recorded too few passes'}"
                                   f"\n  repro: {repro}")
        count += _compare_passes(scenario, adapter_spec, kind, second, expected, repro, " (a second context)")
    return Checked(count, details={"seconds": rec.get("seconds")})


__all__ = ["Mismatch", "judge", "fetch_debug_info", "fetch_grads", "run"]
