"""What the per-area tests share: a scenario by its id, and "this known-bad implementation is
caught, with a message that names the scenario and says what is wrong" (test_area_*.py)."""

from __future__ import annotations

import contextlib

import pytest

from conformance import catalogue
from conformance.judge.compare import ConformanceError


def scenario(scenario_id: str):
    """The catalogue's scenario with this id (every profile)."""
    return next(s for s in catalogue.all_scenarios() if s.id == scenario_id)


def mutant_spec(area: str, name: str) -> str:
    """The adapter spec of mutant `name` of an area zoo (`conformance.mutants.<area>`)."""
    return f"conformance.mutants.{area}:{name.replace('-', '_')}"


def assert_caught(check, scenario_id: str, spec: str, needle: str) -> ConformanceError:
    """`check(scenario, spec)` must fail, naming the scenario and showing `needle`; returns the error."""
    with pytest.raises(ConformanceError) as info:
        check(scenario(scenario_id), spec)
    message = str(info.value)
    assert scenario_id in message and needle in message, message
    return info.value


@contextlib.contextmanager
def recording(session):
    """While open, every task a rank pool of `session` runs appends its outcome to the yielded list
    (the workers' records: a mutant's firing counts are in them)."""
    outcomes, pool_run = [], session.pools.get

    class Recording:
        def __init__(self, pool):
            self.pool = pool

        def run(self, *args, **kwargs):
            outcomes.append(self.pool.run(*args, **kwargs))
            return outcomes[-1]

    session.pools.get = lambda topology: Recording(pool_run(topology))
    try:
        yield outcomes
    finally:
        del session.pools.get
