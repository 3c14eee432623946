"""The bucketer area's catalogue: the hand-written scenarios (pinned, `conformance.catalogue.bucketer`)
and the covering arrays generated around them from the area's space (`conformance.space.bucketer`,
issue 38). Apart from the hand-written catalogue because the space's rows are built with its
`make` and `plan` (`conformance.space.bucketer_rows`).
"""

from __future__ import annotations

from conformance.catalogue import bucketer
from conformance.spec import Scenario


def scenarios() -> list[Scenario]:
    """The hand-written scenarios (pinned) and the covering arrays generated from the area's space
    around them (`conformance.space.bucketer`, issue 38)."""
    from conformance.space.profiles import generated

    pinned = bucketer.handwritten()
    return pinned + generated("bucketer", pinned)


def full_generated() -> list[Scenario]:
    """The strength-3 rows of full that quick and standard's arrays do not already hold."""
    from conformance.space.profiles import generated

    pinned = bucketer.handwritten()
    have = {s.id for s in generated("bucketer", pinned)}
    return [s for s in generated("bucketer", pinned, full=True) if s.id not in have]
