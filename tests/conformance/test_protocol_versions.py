"""Protocols evolve without breaking adapters (#40, #41): every optional hook is declared in the
protocol types with its default, a keyword a call gained later is detected on the adapter's
signature, and an adapter written to each earlier protocol version keeps passing what it could
always run; the scenarios that need a newer part are skipped at plan time with the change to make."""

import pytest

from conformance.adapters import optional
from conformance.adapters.protocol import AdapterHooks, WrappedHooks
from conformance.case import Case
from conformance.pipeline import run_case
from conformance.plan import Selection, make_plan
from tests.conformance.area_cases import scenario

OLD = "tests.conformance.old_protocol_adapters"


@pytest.mark.parametrize(("types", "hooks"), [(AdapterHooks, optional.ADAPTER_HOOKS),
                                               (WrappedHooks, optional.WRAPPED_HOOKS)])
def test_every_optional_hook_is_in_the_protocol_types_with_its_default(types, hooks):
    declared = {n: getattr(types, n) for n in types.__annotations__}
    assert declared == {n: default for n, (default, _) in hooks.items()}
    assert optional.hook(object(), "checkpoint_api") is False and optional.hook(object(), "owns") == frozenset()


def test_every_optional_part_the_suite_reads_is_declared():
    """A hook read by `getattr`/`hasattr` on an adapter or a Wrapped anywhere in the suite is declared
    (with its default) or a required protocol member: no hook outside the protocol's types."""
    import re
    from pathlib import Path

    from conformance.adapters.protocol import Adapter, Wrapped

    required = set(Adapter.__annotations__) | {"wrap"} | set(Wrapped.__annotations__) | {
        n for n in vars(Wrapped) if not n.startswith("_")}
    declared = set(optional.ADAPTER_HOOKS) | set(optional.WRAPPED_HOOKS) | required
    pattern = re.compile(r"(?:getattr|hasattr)\((?:adapter|wrapped|self\._wrapped), \"(\w+)\"")
    root = Path(optional.__file__).parents[1]
    read = {m for p in root.rglob("*.py") if "engines" not in p.parts and "mutants" not in p.parts
            for m in pattern.findall(p.read_text())}
    assert read and read <= declared, f"hooks read but not declared in protocol.AdapterHooks/WrappedHooks: {read - declared}"


def _planned(spec: str, profile: str = "standard"):
    return make_plan(Selection(adapters=(spec,), profile=profile)).cases


def test_a_data_parallel_adapter_from_before_module_kwargs_skips_those_scenarios_with_the_change():
    cases = _planned(f"{OLD}:data_parallel_before_kwargs")
    kwargs = [c for c in cases if "kwargs" in c.scenario.id]
    assert kwargs and all("data_parallel() has no `module_kwargs` parameter" in c.skip
                          and "add `module_kwargs=None` to data_parallel()" in c.skip for c in kwargs)
    assert [c for c in cases if not c.skip]  # the rest still runs
    refimpl = _planned("refimpl-data-parallel")  # the current protocol: nothing skipped for it
    assert not any("earlier protocol" in (c.skip or "") for c in refimpl)


def test_the_data_parallel_adapter_from_before_module_kwargs_passes_the_rest(session):
    cases = [c for c in _planned(f"{OLD}:data_parallel_before_kwargs", "quick") if not c.skip]
    verdicts = {c.scenario.id: run_case(c, session).verdict for c in cases}
    assert verdicts and set(verdicts.values()) == {"passed"}, verdicts


def test_a_keyword_a_declared_v2_part_needs_is_detected_too():
    cases = _planned(f"{OLD}:ddp_owns_optimizer_without_keyword", "quick")
    assert cases and all(c.skip for c in cases)  # never run and counted as the engine's TypeError
    assert all("wrap() has no `optimizer` parameter" in c.skip for c in cases if "lacks capability" not in c.skip)
    assert any("add `optimizer=None` to wrap()" in c.skip for c in cases)
    assert not any(c.skip for c in _planned(f"{OLD}:ddp_v1", "quick") if "earlier protocol" in (c.skip or ""))


@pytest.mark.slow
@pytest.mark.parametrize("scenario_id", ["ddp/plain/mlp/w2/fp32", "ddp/no-sync/mlp/w2/fp32"])
def test_a_protocol_v1_ddp_adapter_still_passes(scenario_id, session):
    result = run_case(Case(scenario(scenario_id), f"{OLD}:ddp_v1"), session)
    assert result.verdict == "passed", result.message
