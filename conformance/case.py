"""A `Case`: one scenario against one adapter, as planned, and its id.

Planning (`conformance.plan`) makes cases; the pipeline (`conformance.pipeline`) runs them; the
reports (`conformance.report.record`) and the expectations files name them by `Case.id`,
`<adapter spec>|<scenario id>` (the separator is `CASE_SEPARATOR`; pytest's node ids carry the
same string as their parameter). Its own module so that planning and the pipeline are siblings
that both read it, and neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.area import Area
from conformance.area import get as get_area
from conformance.spec import Scenario

CASE_SEPARATOR = "|"


def case_id(adapter_spec: str, scenario: Scenario) -> str:
    return f"{adapter_spec}{CASE_SEPARATOR}{scenario.id}"


@dataclass(frozen=True)
class Case:
    """One scenario against one adapter, as planned: `skip` (a reason) or `xfail` (a reason) or neither."""

    scenario: Scenario
    adapter_spec: str
    skip: str = ""
    xfail: str | None = None

    @property
    def id(self) -> str:
        return case_id(self.adapter_spec, self.scenario)

    @property
    def area(self) -> Area:
        return get_area(self.scenario.area)

    def __str__(self) -> str:
        return self.id
