"""What the per-area tests share: a scenario by its id, and "this known-bad implementation is
caught, with a message that names the scenario and says what is wrong" (test_area_*.py)."""

from __future__ import annotations

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
