"""An `Area` is one contract the suite checks, defined in one place; `AREAS` is the registry.

Everything that needs to know the areas — the scenario catalogue, `Scenario`'s validation, the
CLI's choices, the zoo, the torchrun launcher and the reports — derives them from `AREAS`, so
adding an area means adding one entry here (and its catalogue, rank task and judge modules).

An area's pieces are functions, not "module:attr" strings:

- `scenarios()`  its catalogue (every profile; `conformance.catalogue.select` filters);
- `task(payload, ctx)`  what runs on every rank of a world for one case, with
  `payload = (scenario, adapter_spec)`; it returns a record and judges nothing. An
  `in_process` area (data_parallel: one process drives several replicas) runs its task in the
  coordinator with `ctx=None`;
- `judge(scenario, adapter_spec, records)`  the one judging signature of every area: the
  ranks' records (`{rank: record}`, every rank answered) against the `oracle`; returns a
  `Checked` or raises `ConformanceError` at the first violation;
- `oracle`  what the judge compares with (named here so a reader finds it from the area).

The pipeline (`conformance.pipeline.run_case`) calls them in that order for every front end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# The area names, first: the catalogues below build `Scenario`s at import, which check their
# area against this (the registry at the bottom must list exactly these, in this order).
NAMES: tuple[str, ...] = ("ddp", "data_parallel", "dist_autograd", "bucketer", "sharded")

from conformance.catalogue import bucketer as bucketer_catalogue  # noqa: E402
from conformance.catalogue import data_parallel as data_parallel_catalogue  # noqa: E402
from conformance.catalogue import ddp as ddp_catalogue  # noqa: E402
from conformance.catalogue import dist_autograd as dist_autograd_catalogue  # noqa: E402
from conformance.catalogue import sharded as sharded_catalogue  # noqa: E402
from conformance.runners import bucketer, data_parallel, ddp, dist_autograd  # noqa: E402


@dataclass(frozen=True)
class Area:
    name: str
    about: str  # one line: what is checked
    scenarios: Callable[[], Iterable[Any]]
    task: Callable[[Any, Any], Any]
    judge: Callable[[Any, str, dict], Any]
    oracle: Callable[..., Any]
    in_process: bool = False  # single-process: the task runs in the coordinator, no rank world
    rank_device: str | None = None  # ranks use this device whatever the run's (dist_autograd: RPC is CPU)

    def __str__(self) -> str:
        return self.name

    @property
    def task_ref(self) -> str:
        """The task as `module:name`, for rank processes that import it (the pool's wire format)."""
        return f"{self.task.__module__}:{self.task.__qualname__}"

    def topology(self, scenario):
        """Where a scenario of this area runs: a world of its size on its (or the area's) device."""
        from conformance.harness.context import choose_topology

        return choose_topology(scenario.world_size, self.rank_device or scenario.device)


def _baseline_oracle(scenario, semantics=None):
    from conformance import baseline
    from conformance.semantics import TORCH_DDP

    return baseline.compute(scenario, semantics or TORCH_DDP)


AREAS: dict[str, Area] = {
    a.name: a
    for a in (
        Area("ddp", "the DDP contract: construction sync, averaged grads, no_sync, unused parameters, buffers",
             ddp_catalogue.scenarios, ddp.run, ddp.judge, _baseline_oracle),
        Area("data_parallel", "single-process replicate/scatter/gather vs one full-batch backward",
             data_parallel_catalogue.scenarios, data_parallel.run, data_parallel.judge, data_parallel.oracle_forward,
             in_process=True),
        Area("dist_autograd", "gradients in distributed-autograd contexts vs local autograd over the same composition",
             dist_autograd_catalogue.scenarios, dist_autograd.run, dist_autograd.judge, dist_autograd.oracle,
             rank_device="cpu"),
        Area("bucketer", "bucketed reduce-scatter = exact sum of chunks; callbacks exactly once, in order",
             bucketer_catalogue.scenarios, bucketer.run, bucketer.judge, bucketer.expected_result),
        Area("sharded", "the DDP contract on gathered (unsharded) grads and params",
             sharded_catalogue.scenarios, ddp.run, ddp.judge, _baseline_oracle),
    )
}
assert tuple(AREAS) == NAMES, "conformance.area: NAMES and AREAS disagree"


def get(name: str) -> Area:
    try:
        return AREAS[name]
    except KeyError:
        raise ValueError(f"unknown area {name!r}; one of {', '.join(NAMES)}") from None
