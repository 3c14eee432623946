"""What registers an area: one `AreaEntry`, the module `conformance/areas/<name>.py` holds.

An entry names where each piece of the area lives, as `module` or `module:attribute` strings,
like the adapter registry's built-ins: the entry sits on the ground floor of the layers (it
imports nothing of the project), so every layer can read it, and each reads only the pieces of
its own layer or below (`conformance.catalogue` its scenario functions, `conformance.mutants`
its zoos, `conformance.adapters.registry` its built-in adapters, `conformance.area` the runner
and the oracle).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AreaEntry:
    name: str
    order: int  # where the area comes in every list of areas (CLI choices, plans, reports)
    about: str  # one line: what is checked
    catalogue: str  # "module:function": the hand-written scenarios (with the generated arrays around them: `catalogue.scenarios`)
    runner: str  # module with the rank task `run(payload, ctx)` and `judge(scenario, adapter_spec, records)`
    oracle: str  # "module:function": what the judge compares with (in conformance/oracle/)
    adapters: dict[str, str] = field(default_factory=dict)  # built-in adapters: name -> "module:factory"
    mutants: str = ""  # module of the area's own zoo (conformance/mutants/)
    controls: tuple[str, ...] = ()  # built-in adapters the zoo runs beside its correct base
    independent: str = ""  # module of the zoo written from the contract alone (conformance/mutants/independent/)
    interactions: str = ""  # module of its interaction zoo (issue 38: bugs where two things meet)
    in_process: bool = False  # single-process: the task runs in the coordinator, no rank world
    rank_device: str | None = None  # ranks use this device whatever the run's (dist_autograd: RPC is CPU)
