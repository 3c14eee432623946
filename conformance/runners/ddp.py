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
from conformance.adapters.protocol import OptimizerSpec, owned
from conformance.models import rng
from conformance.models.data import (
    build_model,
    forward_loss,
    make_inputs,
    make_optimizer,
    model_loss,
)
from conformance.runners import build_order as orders
from conformance.spec import Expect, Scenario

SKEW_S = 0.25  # how long the last rank sleeps in rank-skewed scenarios (never judged as time)


def run(payload, ctx) -> dict:
    scenario, adapter_spec = payload
    scenario: Scenario
    if scenario.features:  # join, AMP, compile, checkpoints ...: their own loop
        from conformance.runners import ddp_features

        return ddp_features.run(payload, ctx)
    return _Run(scenario, registry.load(adapter_spec), ctx).record_all()


class _Run:
    """One rank's training loop, recorded after every backward and every step, in the phases
    the oracle replays (`conformance.oracle.baseline`):

        1. construction      the rank's own model (rank-dependent on purpose), wrapped; the
                             optimizer (the engine's own, where it owns it: protocol v2), built
                             after wrapping or before it (conformance.runners.build_order)
        2. local gradients   every micro-batch but the last inside `no_sync()`
        3. synced reduce     the last micro-batch's backward, which the engine reduces
        4. step              the optimizer step and zero_grad, then parameters and buffers

    It records and judges nothing: the coordinator compares the record with the oracle.
    """

    # -- 1. construction --------------------------------------------------------------------
    def __init__(self, scenario: Scenario, adapter, ctx):
        self.scenario, self.ctx = scenario, ctx
        self.owns = owns = owned(adapter, scenario)
        torch.manual_seed(rng.seed_of(scenario.seed, ctx.rank))  # the stream dropout draws from (conformance.models.rng)
        self.record: dict = {"events": [], "error": None, "seconds": {}}
        self.model = build_model(
            scenario.model, scenario.kwargs(), seed=scenario.seed, rank=ctx.rank,
            dtype=scenario.dtype, device=ctx.device, exact=scenario.exact_data,
        )
        self.tap = rng.ForwardTap(self.model, ctx.device)  # the RNG state each forward of the user's module starts from
        t0 = time.perf_counter()
        # optimizer-first (conformance.runners.build_order): over the bare module's parameters,
        # which the wrapper must keep (torch DDP does)
        early = orders.optimizer_first(scenario, owns)
        if early:
            self.optimizer = make_optimizer(scenario.optimizer, orders.trainable(self.model))
        if "optimizer" in owns:  # protocol v2: the engine builds (and steps) its own optimizer
            spec = OptimizerSpec(scenario.optimizer, micro_batches=scenario.micro_batches)
            self.wrapped = adapter.wrap(self.model, ctx, scenario.options, optimizer=spec)
        else:
            self.wrapped = adapter.wrap(self.model, ctx, scenario.options)
        self.record["seconds"]["wrap"] = time.perf_counter() - t0
        self.record["init"] = {"parameters": self.wrapped.full_parameters(), "buffers": self.wrapped.full_buffers()}
        if "optimizer" in owns:
            self.optimizer = self.wrapped.optimizer
        elif not early:
            self.optimizer = make_optimizer(scenario.optimizer, self.wrapped.optimizer_parameters())
        self.backward = self.wrapped.backward if "backward" in owns else (lambda loss: loss.backward())
        self.skewed = scenario.skew and ctx.rank == scenario.world_size - 1
        self.step = self.micro = 0

    def record_all(self) -> dict:
        scenario, record = self.scenario, self.record
        t0 = time.perf_counter()
        try:
            for step in range(scenario.steps):
                self.step = step
                if scenario.kwargs().get("discard_no_sync") and self.optimizer is not None:
                    self._discarded_no_sync(step)
                for micro in range(scenario.micro_batches):
                    self.micro = micro
                    self._backward(step, micro, synced=micro == scenario.micro_batches - 1)
                self._step(step)
        except Exception as exc:
            accepted = scenario.expect == Expect.MATCH_OR_ERROR and re.search(scenario.error_pattern, str(exc))
            if not accepted:
                raise
            record["error"] = {
                "type": type(exc).__name__, "message": str(exc), "step": self.step, "micro": self.micro,
                "traceback": traceback.format_exc(),
            }
        record["seconds"]["train"] = time.perf_counter() - t0
        self._close()
        return record

    # -- 2. local gradients and 3. synced reduce --------------------------------------------
    def _inputs(self, step: int, micro: int):
        scenario, ctx = self.scenario, self.ctx
        (x,) = make_inputs(scenario.model, seed=scenario.seed, rank=ctx.rank, step=step, micro=micro,
                           size=scenario.shard_size(ctx.rank), dtype=scenario.dtype, device=ctx.device)
        return x

    def _discarded_no_sync(self, step: int) -> None:
        """Issue 30 (end of life of a local accumulation): a no_sync() backward thrown away by
        zero_grad() before the step's own micro-batches; nothing of it may reach the step."""
        scenario, wrapped, rank = self.scenario, self.wrapped, self.ctx.rank
        x = self._inputs(step, scenario.micro_batches)
        with wrapped.no_sync():
            self.backward(model_loss(wrapped, scenario.model, x, rank=rank, micro=scenario.micro_batches))
        _zero_grad(scenario, step, self.optimizer, wrapped, self.owns)

    def _backward(self, step: int, micro: int, synced: bool) -> None:
        """One micro-batch: inside no_sync() unless it is the step's last (the synced one)."""
        scenario, wrapped, ctx = self.scenario, self.wrapped, self.ctx
        x = self._inputs(step, micro)
        self.tap.take()  # a forward outside this micro-batch (discard_no_sync) is not this one's
        if scenario.kwargs().get("no_sync_split"):
            # Issue 30 (when is the flag read?): the forward decides (torch DDP's rule), so a
            # forward inside no_sync() whose backward runs outside it accumulates locally,
            # and a forward outside whose backward runs inside it is reduced.
            with contextlib.nullcontext() if synced else wrapped.no_sync():
                loss = model_loss(wrapped, scenario.model, x, rank=ctx.rank, micro=micro)
            with wrapped.no_sync() if synced else contextlib.nullcontext():
                self.backward(loss)
        else:
            with contextlib.nullcontext() if synced else wrapped.no_sync():
                loss = forward_loss(wrapped, scenario, x, rank=ctx.rank, step=step, micro=micro,
                                    device=ctx.device)
                if self.skewed and scenario.skew == "backward":
                    time.sleep(SKEW_S)
                self.backward(loss)
        self.record["events"].append(
            {"kind": "backward", "step": step, "micro": micro, "synced": synced, "values": wrapped.full_gradients(),
             "loss": loss.detach().to("cpu", copy=True),  # for --record (conformance.recording); never judged
             "shards": _local_shards(wrapped) if synced else None,  # sharded area: conformance/judge/shards.py
             "rng": self.tap.take()}  # where this forward's random numbers started (the oracle replays it)
        )

    # -- 4. step ----------------------------------------------------------------------------
    def _step(self, step: int) -> None:
        scenario, wrapped = self.scenario, self.wrapped
        if self.optimizer is not None:
            if self.skewed and scenario.skew == "step":
                time.sleep(SKEW_S)
            self.optimizer.step()
            _zero_grad(scenario, step, self.optimizer, wrapped, self.owns)
        self.record["events"].append(
            {"kind": "step", "step": step, "values": wrapped.full_parameters(), "buffers": wrapped.full_buffers(),
             "shards": _local_shards(wrapped)}
        )

    def _close(self) -> None:
        """What the engine reports beside its values (optional protocol hooks), then close it."""
        wrapped, record = self.wrapped, self.record
        stats = getattr(wrapped, "backward_stats", None)
        record["backward_stats"] = stats() if callable(stats) else None
        probe = getattr(wrapped, "allreduce_probe", None)  # optional (protocol): the backend's summation order
        record["allreduce_probe"] = probe() if callable(probe) else None
        close = getattr(wrapped, "close", None)  # the optional Wrapped.close() (protocol)
        if callable(close):
            close()
        del self.wrapped, self.optimizer, self.model, self.backward


def _local_shards(wrapped) -> dict | None:
    """Each rank's own shards where a sharded adapter exposes them (optional `Wrapped.local_shards`)."""
    local = getattr(wrapped, "local_shards", None)
    return local() if callable(local) else None


def _zero_grad(scenario: Scenario, step: int, optimizer, wrapped, owns) -> None:
    """Clear gradients the way the scenario says (the user's optimizer unless stated otherwise)."""
    set_to_none = scenario.zero_grad != "alternate" or step % 2 == 0
    if scenario.zero_grad == "engine" or "zero_grad" in owns:
        wrapped.zero_grad(set_to_none=set_to_none)
    else:
        optimizer.zero_grad(set_to_none=set_to_none)


def judge(scenario: Scenario, adapter_spec: str, records: dict[int, dict]):
    """Compare every rank's record with the oracle (under the adapter's declared semantics)."""
    from conformance.judge import contract
    from conformance.oracle import baseline
    from conformance.semantics import declared

    semantics = declared(registry.load(adapter_spec), scenario)
    anchored, straight = baseline.oracles(scenario, semantics, records)
    try:
        checked = contract.check_records(scenario, adapter_spec, anchored, records, semantics=semantics,
                                         straight_through=straight)
    except contract.ConformanceError as exc:  # where it diverged, every event x tensor (the HTML draws it)
        from conformance.judge.divergence import divergence_map
        from conformance.oracle.envelope import rule_of

        exc.details = {"divergence": divergence_map(anchored, records, rule_of(scenario, semantics),
                                                    contract.EXACT_AFTER_STEP)}
        raise
    # Every declared deviation from torch DDP's rules travels with the verdict into the report.
    checked.details.update(declared=semantics.deviations(), declared_sources=list(semantics.sources))
    if scenario.area == "sharded":  # each rank's own shard, as well as the gathered tensors (S12)
        from conformance.judge.shards import check_local_shards

        count, details = check_local_shards(scenario, adapter_spec, records, contract.repro_command(scenario, adapter_spec))
        checked.comparisons += count
        checked.details.update(details)
    if scenario.features:
        from conformance.runners.ddp_features import check_determinism

        checked.details["determinism"] = check_determinism(scenario, adapter_spec, records)
    return checked
