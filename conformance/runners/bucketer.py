"""The `bucketer` area: rank side (`run`) and coordinator side (`judge`, oracle `expected_result`).

Each rank replays the scenario's plan (`conformance.catalogue.bucketer.plan`) against the
adapter's bucketer and records a log of what happened, in order — call entered, callback
(with a copy of the value it received), call returned, flush entered/returned — plus the
tensors the callbacks received, read again after the round's flush. The coordinator rebuilds
every rank's expected sums from the same seeds and judges the contract stated in the
catalogue's docstring. Nothing is judged on the ranks.
"""

from __future__ import annotations

import time

import torch

from conformance.adapters import registry
from conformance.catalogue.bucketer import (
    chunk,
    end_of_life_calls,
    group_members,
    must_be_deferred,
    must_be_immediate,
    plan,
    with_layout,
)
from conformance.judge.compare import ConformanceError, compare_tensor, failure_message
from conformance.judge.contract import Checked, repro_command
from conformance.oracle.bucketer import expected_result
from conformance.spec import Scenario

_GROUPS: dict[tuple, object] = {}  # (world group, kind, rank) -> this rank's group of that kind


def _group(ctx, kind: str):
    """This rank's process group of `kind`, created once per rank process (every rank creates
    every group of the kind, in the same order: `new_group` is collective over the world)."""
    import torch.distributed as dist

    if kind == "world":
        return ctx.group
    key = (id(ctx.group), kind, ctx.rank)
    if key not in _GROUPS:
        W = ctx.world_size
        made = {}
        for r in range(W):
            members = tuple(group_members(kind, r, W))
            if members not in made:
                made[members] = dist.new_group(list(members))
        _GROUPS[key] = made[tuple(group_members(kind, ctx.rank, W))]
    return _GROUPS[key]


def run(payload, ctx) -> dict:
    scenario, adapter_spec = payload
    scenario: Scenario
    adapter = registry.load(adapter_spec)
    calls = plan(scenario)
    kw = scenario.kwargs()
    reuse, keyword, idle_flush = bool(kw.get("reuse")), bool(kw.get("keyword")), bool(kw.get("idle_flush"))
    W, rank = ctx.world_size, ctx.rank
    queued_at_end = end_of_life_calls(scenario) if kw.get("teardown_queued") else []
    groups = {kind: _group(ctx, kind) for kind in sorted({c.group for c in calls + queued_at_end})}
    bucketer = adapter.make(scenario.options.bucket_cap_mb)
    rounds = []
    error = None
    t0 = time.perf_counter()
    default_dtype = torch.get_default_dtype()
    if kw.get("default_dtype"):  # ambient state (issue 30): restored below, the rank serves later cases
        torch.set_default_dtype(getattr(torch, kw["default_dtype"]))
    try:
        for round_ in range(scenario.steps):
            log: list[tuple] = []
            kept: dict[int, list[torch.Tensor]] = {}

            def callback(out, i, log=log, kept=kept):
                log.append(("callback", i, out.detach().to("cpu", copy=True)))
                kept.setdefault(i, []).append(out)

            if idle_flush:  # nothing queued yet: a no-op
                bucketer.flush()
            for i, call in enumerate(calls):
                if not call.active(round_):
                    continue
                size = len(group_members(call.group, rank, W))
                inputs = [with_layout(chunk(scenario, round_=round_, rank=rank, index=i, dest=d, call=call,
                                            device=ctx.device), call.layout) for d in range(size)]
                log.append(("enter", i))
                fn = (lambda out, i=i: callback(out, i)) if call.callback else None
                if keyword:
                    bucketer.reduce_scatter_async(input_list=inputs, group=groups[call.group], callback_fn=fn)
                else:
                    bucketer.reduce_scatter_async(inputs, groups[call.group], fn)
                log.append(("return", i))
                if reuse:
                    for t in inputs:
                        t.fill_(99)
            log.append(("flush",))
            bucketer.flush()
            if idle_flush:
                bucketer.flush()
            log.append(("flushed",))
            teardown = getattr(bucketer, "teardown", None)
            if kw.get("teardown_queued") and round_ == scenario.steps - 1 and callable(teardown):
                _teardown_queued(scenario, bucketer, groups, ctx, round_, len(calls), log, callback)
            elif callable(teardown):
                teardown()
            after = {i: [t.detach().to("cpu", copy=True) for t in ts] for i, ts in kept.items()}
            rounds.append({"log": log, "after_flush": after})
    except Exception as exc:  # noqa: BLE001 - recorded and judged: the pool stays healthy
        error = f"{type(exc).__name__}: {exc}"
    finally:
        torch.set_default_dtype(default_dtype)
    # Known-bad bucketers count where their bug changed what the correct one would have done.
    return {"rounds": rounds, "seconds": time.perf_counter() - t0, "error": error,
            "mutation_fired": getattr(bucketer, "mutation_fired", None)}


def _teardown_queued(scenario, bucketer, groups, ctx, round_, index, log, callback) -> None:
    """Issue 30, end of life: more inputs queued after the last flush, then `teardown()`.
    The log says whether teardown raised (refused loudly) or returned."""
    for i, call in enumerate(end_of_life_calls(scenario), start=index):
        size = len(group_members(call.group, ctx.rank, ctx.world_size))
        inputs = [chunk(scenario, round_=round_, rank=ctx.rank, index=i, dest=d, call=call, device=ctx.device)
                  for d in range(size)]
        log.append(("enter", i))
        bucketer.reduce_scatter_async(inputs, groups[call.group], lambda out, i=i: callback(out, i))
        log.append(("return", i))
    try:
        bucketer.teardown()
        log.append(("teardown", "returned"))
    except Exception as exc:  # noqa: BLE001 - refusing loudly is one of the two right answers
        log.append(("teardown", f"raised {type(exc).__name__}"))


def judge(scenario: Scenario, adapter_spec: str, records: dict[int, dict]) -> Checked:
    """Raise ConformanceError at the first violation (rank by rank, round by round)."""
    missing = [r for r in range(scenario.world_size) if r not in records]
    if missing:
        raise ConformanceError(f"[{scenario.id}] adapter {adapter_spec}: no result from rank(s) {missing}")
    judged = _Judge(scenario, adapter_spec)
    for rank in range(scenario.world_size):
        if records[rank].get("error"):
            judged.fail(rank, f"round {len(records[rank]['rounds'])}",
                        f"the implementation raised {records[rank]['error']}")
        rounds = records[rank]["rounds"]
        if len(rounds) != scenario.steps:
            judged.fail(rank, "at the end", f"{len(rounds)} rounds recorded, {scenario.steps} expected")
        for round_, rec in enumerate(rounds):
            judged.round(rank, round_, rec)
    return Checked(judged.count)


class _Judge:
    """One rank's round, in the contract's order: every callback as it ran (once, after its call,
    never after flush, the exact sum); nothing lost or dropped at teardown; results still valid
    after later flushes; immediate where documented; deferred ones in submission order."""

    def __init__(self, scenario: Scenario, adapter_spec: str):
        self.scenario, self.adapter_spec = scenario, adapter_spec
        self.tol = scenario.tolerance
        self.repro = repro_command(scenario, adapter_spec)
        self.count = 0

    def fail(self, rank, where, what, mismatches=()):
        raise ConformanceError(failure_message(
            scenario_id=self.scenario.id, adapter=self.adapter_spec, rank=rank, where=where, what=what,
            mismatches=list(mismatches), tol=self.tol, repro=self.repro,
        ))

    def round(self, rank: int, round_: int, rec: dict) -> None:
        scenario = self.scenario
        where = f"round {round_}"
        end_of_life = bool(scenario.kwargs().get("teardown_queued")) and round_ == scenario.steps - 1
        planned = plan(scenario)
        calls = planned + (end_of_life_calls(scenario) if end_of_life else [])
        eol = set(range(len(planned), len(calls)))  # the inputs queued at teardown()
        seen, expected = self._callbacks(rank, round_, where, rec["log"], calls, eol)
        self._nothing_lost(rank, round_, where, rec["log"], calls, eol, seen)
        self._still_valid(rank, round_, where, rec["after_flush"], calls, expected)
        self._in_order(rank, where, calls, seen)
        self.count += 1

    def _callbacks(self, rank, round_, where, log, calls, eol) -> tuple[dict, dict]:
        """Every callback in the log: (index -> (position, call in progress), index -> its exact sum)."""
        scenario = self.scenario
        entered: set[int] = set()
        inside: int | None = None  # the call in progress
        flushed = False
        seen: dict[int, tuple[int, int | None]] = {}  # index -> (position, call in progress)
        expected: dict[int, torch.Tensor] = {}  # index -> its exact sum, computed once
        for pos, event in enumerate(log):
            kind = event[0]
            if kind == "enter":
                inside = event[1]
                entered.add(inside)
            elif kind == "return":
                inside = None
            elif kind == "flushed":
                flushed = True
            elif kind == "callback":
                i, value = event[1], event[2]
                call = calls[i]
                if not call.callback:
                    self.fail(rank, where, f"a callback ran for call {i}, which passed callback_fn=None")
                if flushed and i not in eol:
                    self.fail(rank, where, f"call {i}'s callback ran after flush() returned")
                if i not in entered:
                    self.fail(rank, where, f"call {i}'s callback ran before reduce_scatter_async was called for it")
                if i in seen:
                    self.fail(rank, where, f"call {i}'s callback ran a second time (exactly once is required)")
                seen[i] = (pos, inside)
                expected[i] = expected_result(scenario, round_, rank, i, call)
                m = compare_tensor(f"call {i} {call.dtype}{list(call.shape)}", expected[i], value, self.tol)
                self.count += 1
                if m:
                    members = group_members(call.group, rank, scenario.world_size)
                    group = "" if call.group == "world" else f" of its group {members}"
                    self.fail(rank, where, f"call {i}: the callback's result is not the sum over ranks{group} of "
                                           f"chunk {members.index(rank)}", [m])
        return seen, expected

    def _nothing_lost(self, rank, round_, where, log, calls, eol, seen) -> None:
        teardown = next((e[1] for e in log if e[0] == "teardown"), None)
        if eol and teardown is None:
            self.fail(rank, where, "teardown() with an input queued: no outcome recorded")
        # A teardown that refused loudly leaves the queued input's callback to a later flush.
        excused = eol if teardown != "returned" else set()
        lost = [i for i, c in enumerate(calls) if c.callback and c.active(round_) and i not in seen
                and i not in excused]
        dropped = [i for i in lost if i in eol]
        if dropped:
            self.fail(rank, where, f"teardown() with call(s) {dropped} still queued returned without running their "
                                   "callbacks and without raising: queued work dropped silently (run it, or refuse "
                                   "loudly)")
        if lost:
            self.fail(rank, where, f"callbacks of call(s) {lost[:10]} never ran by the end of flush() "
                                   f"({len(lost)} of {sum(c.callback for c in calls)})")

    def _still_valid(self, rank, round_, where, after_flush, calls, expected) -> None:
        """Results stay valid after later flushes and after teardown() (the snapshot is taken after it)."""
        for i, tensors in sorted(after_flush.items()):
            call = calls[i]
            want = expected[i] if i in expected else expected_result(self.scenario, round_, rank, i, call)
            m = compare_tensor(f"call {i} {call.dtype}{list(call.shape)}", want, tensors[0], self.tol)
            self.count += 1
            if m:
                self.fail(rank, where, f"call {i}: the result handed to the callback changed after a later "
                                       "flush or teardown() (it must stay valid)", [m])

    def _in_order(self, rank, where, calls, seen) -> None:
        scenario = self.scenario
        # Order 4a: immediate where documented.
        for i, (_pos, during) in sorted(seen.items()):
            if must_be_immediate(scenario, calls[i], rank) and during != i:
                when = "during flush()" if during is None else f"during call {during}"
                self.fail(rank, where, f"call {i} ({calls[i].numel} elements > one shard of the bucket, or bucketing "
                                       f"disabled) must be reduced before its call returns; its callback ran {when}")
        # Order 4b: deferred callbacks of one dtype and group in submission order.
        last: dict[tuple, tuple[int, int]] = {}
        for pos, i in sorted((p, i) for i, (p, during) in seen.items()
                             if during != i or must_be_deferred(scenario, calls[i], rank)):
            key = (calls[i].dtype, calls[i].group)
            if key in last and last[key][1] > i:
                self.fail(rank, where, f"deferred {key[0]} callbacks out of submission order: call {i}'s ran after "
                                       f"call {last[key][1]}'s (a bucket runs its callbacks first in, first out)")
            last[key] = (pos, i)
