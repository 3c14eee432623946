"""Rank side of the `ddp` and `sharded` areas: train a scenario and record everything.

The record holds, in order, every rank-visible fact the contract speaks of: the state after
construction, the gradients after every backward (synced or inside `no_sync()`), and the
parameters and buffers after every optimizer step. The coordinator compares it with the
oracle; nothing is judged here.
"""

from __future__ import annotations

import contextlib
import re
import time
import traceback

import torch

from conformance.adapters import registry
from conformance.fixtures.data import build_model, loss_fn, make_inputs, make_optimizer
from conformance.spec import Expect, Scenario


def run(payload, ctx) -> dict:
    scenario, adapter_spec = payload
    scenario: Scenario
    adapter = registry.load(adapter_spec)
    torch.manual_seed(scenario.seed)
    record: dict = {"events": [], "error": None, "seconds": {}}
    model = build_model(
        scenario.model, scenario.kwargs(), seed=scenario.seed, rank=ctx.rank,
        dtype=scenario.dtype, device=ctx.device, exact=scenario.exact_data,
    )
    t0 = time.perf_counter()
    wrapped = adapter.wrap(model, ctx, scenario.options)
    record["seconds"]["wrap"] = time.perf_counter() - t0
    record["init"] = {"parameters": wrapped.full_parameters(), "buffers": wrapped.full_buffers()}
    optimizer = make_optimizer(scenario.optimizer, wrapped.optimizer_parameters())
    step = micro = 0
    t0 = time.perf_counter()
    try:
        for step in range(scenario.steps):
            for micro in range(scenario.micro_batches):
                synced = micro == scenario.micro_batches - 1
                (x,) = make_inputs(
                    scenario.model, seed=scenario.seed, rank=ctx.rank, step=step, micro=micro,
                    size=scenario.shard_size(ctx.rank), dtype=scenario.dtype, device=ctx.device,
                )
                with contextlib.nullcontext() if synced else wrapped.no_sync():
                    loss = loss_fn(wrapped(x, rank=ctx.rank, micro=micro))
                    loss.backward()
                record["events"].append(
                    {"kind": "backward", "step": step, "micro": micro, "synced": synced, "values": wrapped.full_gradients()}
                )
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            record["events"].append(
                {"kind": "step", "step": step, "values": wrapped.full_parameters(), "buffers": wrapped.full_buffers()}
            )
    except Exception as exc:
        accepted = scenario.expect == Expect.MATCH_OR_ERROR and re.search(scenario.error_pattern, str(exc))
        if not accepted:
            raise
        record["error"] = {
            "type": type(exc).__name__, "message": str(exc), "step": step, "micro": micro,
            "traceback": traceback.format_exc(),
        }
    record["seconds"]["train"] = time.perf_counter() - t0
    stats = getattr(wrapped, "backward_stats", None)
    record["backward_stats"] = stats() if callable(stats) else None
    del wrapped, optimizer, model
    return record


TASK = "conformance.runners.ddp:run"


def check(scenario: Scenario, adapter_spec: str, session):
    """Coordinator side: run on a warm world, then judge every rank's record against the oracle."""
    from conformance.harness.context import choose_topology

    topology = choose_topology(scenario.world_size, scenario.device)
    outcome = session.pools.get(topology).run(
        TASK, (scenario, adapter_spec),
        timeout=scenario.timeout_s * session.timeout_scale, label=f"{scenario.id} with {adapter_spec}",
    )
    return judge(scenario, adapter_spec, outcome, where=topology.key())


def judge(scenario: Scenario, adapter_spec: str, outcome, where: str = ""):
    """Compare a finished task's per-rank records with the oracle (also used under torchrun)."""
    from conformance import baseline, contract
    from conformance.compare import ConformanceError

    details = {
        "seconds": outcome.seconds,
        "rank_seconds": {r: v.get("seconds") for r, v in outcome.values.items()},
        "backward_stats": {r: v.get("backward_stats") for r, v in outcome.values.items()},
    }
    try:
        if not outcome.ok:
            raise ConformanceError(
                f"[{scenario.id}] adapter {adapter_spec}: the run failed{' on ' + where if where else ''}\n"
                f"{outcome.render_failures()}\n  repro: {contract.repro_command(scenario, adapter_spec)}"
            )
        checked = contract.check_records(scenario, adapter_spec, baseline.compute(scenario), outcome.values)
    except ConformanceError as exc:
        exc.details = details  # the report keeps what the ranks said even when they were wrong
        raise
    checked.details = details
    return checked
