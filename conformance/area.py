"""An `Area` is one contract the suite checks, with its pieces as functions; `AREAS` is the registry.

Each area is registered once, by its module in `conformance/areas/` (an `AreaEntry` naming where
its pieces live); this module turns every entry into an `Area` of live functions, which the
CLI's choices, the plan, the zoo, the torchrun launcher and the reports read. Adding an area is
that one module plus the files it names (`conformance/areas/__init__.py` lists them).

An area's pieces:

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

from conformance import areas, catalogue
from conformance.areas import NAMES  # the names are vocabulary; this is the registry
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


def _area(entry: areas.AreaEntry) -> Area:
    runner = areas.resolve(entry.runner)
    return Area(entry.name, entry.about, catalogue.SCENARIOS[entry.name], runner.run, runner.judge,
                areas.resolve(entry.oracle), in_process=entry.in_process, rank_device=entry.rank_device)


AREAS: dict[str, Area] = {entry.name: _area(entry) for entry in areas.ENTRIES}


def get(name: str) -> Area:
    try:
        return AREAS[name]
    except KeyError:
        raise ValueError(f"unknown area {name!r}; one of {', '.join(NAMES)}") from None
