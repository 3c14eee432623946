"""An `Area` is one contract the suite checks, defined in one place; `AREAS` is the registry.

The layers (docs/design.md, "Layers"): the area *names* are vocabulary, `conformance.spec.AREA_NAMES`
(`Scenario` checks its area against them); the catalogue lists its own area modules
(`conformance.catalogue.SCENARIOS`); this registry sits above both and the runners, and the CLI's
choices, the plan, the zoo, the torchrun launcher and the reports read it. Adding an area: its
name in `AREA_NAMES`, its catalogue module in `catalogue.SCENARIOS`, its rank task and judge in
`conformance/runners/`, and one entry here.

An area's pieces are functions, not "module:attr" strings:

- `scenarios()`  its catalogue (every profile; `conformance.catalogue.select` filters);
- `task(payload, ctx)`  what runs on every rank of a world for one case, with
  `payload = (scenario, adapter_spec)`; it returns a record and judges nothing. An
  `in_process` area (data_parallel: one process drives several replicas) runs its task in the
  coordinator with `ctx=None`;
- `judge(scenario, adapter_spec, records)`  the one judging signature of every area: the
  ranks' records (`{rank: record}`, every rank answered) against the `oracle`; returns a
  `Checked` or raises `ConformanceError` at the first violation;
- `oracle`  what the judge compares with (named here so a reader finds it from the area); every
  area's oracle lives in `conformance/oracle/` (`baseline` for ddp and sharded, `oracle/<area>.py`
  for the others).

The pipeline (`conformance.pipeline.run_case`) calls them in that order for every front end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from conformance import catalogue
from conformance.oracle import baseline
from conformance.oracle import bucketer as bucketer_oracle
from conformance.oracle import data_parallel as data_parallel_oracle
from conformance.oracle import dist_autograd as dist_autograd_oracle
from conformance.runners import bucketer, data_parallel, ddp, dist_autograd
from conformance.spec import AREA_NAMES as NAMES  # the names are vocabulary; this is the registry
from conformance.topology import choose_topology


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
        return choose_topology(scenario.world_size, self.rank_device or scenario.device)


AREAS: dict[str, Area] = {
    a.name: a
    for a in (
        Area("ddp", "the DDP contract: construction sync, averaged grads, no_sync, unused parameters, buffers",
             catalogue.SCENARIOS["ddp"], ddp.run, ddp.judge, baseline.compute),
        Area("data_parallel", "single-process replicate/scatter/gather vs one full-batch backward",
             catalogue.SCENARIOS["data_parallel"], data_parallel.run, data_parallel.judge, data_parallel_oracle.oracle_forward,
             in_process=True),
        Area("dist_autograd", "gradients in distributed-autograd contexts vs local autograd over the same composition",
             catalogue.SCENARIOS["dist_autograd"], dist_autograd.run, dist_autograd.judge, dist_autograd_oracle.oracle,
             rank_device="cpu"),
        Area("bucketer", "bucketed reduce-scatter = exact sum of chunks; callbacks exactly once, in order",
             catalogue.SCENARIOS["bucketer"], bucketer.run, bucketer.judge, bucketer_oracle.expected_result),
        Area("sharded", "the DDP contract on gathered (unsharded) grads and params",
             catalogue.SCENARIOS["sharded"], ddp.run, ddp.judge, baseline.compute),
    )
}
assert tuple(AREAS) == NAMES, "conformance.area: NAMES and AREAS disagree"
assert {n: a.scenarios for n, a in AREAS.items()} == catalogue.SCENARIOS, "conformance.area: catalogues disagree"


def get(name: str) -> Area:
    try:
        return AREAS[name]
    except KeyError:
        raise ValueError(f"unknown area {name!r}; one of {', '.join(NAMES)}") from None
