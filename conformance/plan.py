"""Planning: a selection becomes the list of cases to run, each with its skip or xfail reason.

Shared by every front end (the pytest plugin parametrizes from it, `gradparity zoo` and the
torchrun launcher loop over it), so the same selection means the same cases, skipped and
expected to fail for the same reasons, whichever door a user came through:

1. scenarios: the catalogue filtered by profile, world sizes, device, explicit ids and areas;
2. cases: every scenario × every adapter of its area;
3. capability skips: a scenario needing a capability the adapter lacks is skipped with the
   capability named (never passed); an adapter may also say a scenario cannot run here
   (`adapter.unavailable(scenario)`, e.g. CUDA-only on a CPU run);
4. expectations: entries of the skips files skip, entries of the xfails files (the user's and
   each built-in adapter's `conformance/adapters/xfails/<name>.txt`) mark expected failures.
   An entry is a case id (`adapter|scenario`) or a pytest node id ending in `[adapter|scenario]`;
   a `*` in its scenario part matches any run of characters (`torch-ddp|ddp/pairs/*static-on*accum-*`:
   a generated row's id says its values, so one entry names a pair wherever the array puts it);
   it matches its scenario on every device unless it ends in one (`…/cuda`), and on CUDA an
   ends-world failure is skipped ([Note: expectations on every device] in expectations.py).
   Entries that match no planned case although they could have are reported (stale lists).

Nothing here starts a process or imports an implementation beyond loading its adapter.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from conformance import catalogue
from conformance.adapters import registry
from conformance.adapters.optional import hook, missing_part
from conformance.adapters.protocol import missing_capabilities, owned
from conformance.case import CASE_SEPARATOR, Case
from conformance.expectations import (
    builtin_xfails,
    on_device_reason,
    read_expectations,
    split_device,
)

# The optimizer names an engine that owns its optimizer (protocol v2) is given: the others of the
# optimizer dimension (conformance.space.ddp) are skipped for it with the reason.
ENGINE_OPTIMIZERS = ("sgd", "adam", "none")


@dataclass(frozen=True)
class Selection:
    """What a user asked for (already validated: `conformance.validation`)."""

    adapters: tuple[str, ...] = ()  # adapter specs; empty: the default adapters
    profile: str = "quick"
    areas: tuple[str, ...] = ()  # empty: every area
    world_sizes: tuple[int, ...] = ()
    device: str = "cpu"
    ids: tuple[str, ...] = ()  # explicit scenario ids (whatever their profile)
    xfail_files: tuple[str, ...] = ()
    skip_files: tuple[str, ...] = ()
    keyword: str = ""  # pytest's -k expression over case ids ("" when none): the user's own entries it names are checked
    builtin_xfails: bool = True  # the built-in adapters' lists of known upstream failures
    # The user's own model (`--model`): these scenarios instead of the catalogue's, and no
    # built-in expectations (they name catalogue cases); notes say what was found before any rank started
    user_scenarios: tuple = ()
    notes: tuple[str, ...] = ()

    @property
    def specs(self) -> tuple[str, ...]:
        return self.adapters or registry.DEFAULT_ADAPTERS


@dataclass
class Plan:
    cases: list[Case] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)  # warnings: expectation entries that matched nothing


def plan_cases(selection: Selection) -> list[Case]:
    return make_plan(selection).cases


def make_plan(selection: Selection) -> Plan:
    adapters = {spec: registry.load(spec) for spec in selection.specs}
    chosen = selection.user_scenarios or catalogue.select(profile=selection.profile, world_sizes=selection.world_sizes,
                                                          device=selection.device, ids=selection.ids)
    scenarios = [s for s in chosen if not selection.areas or s.area in selection.areas]
    expectations = _expectations(selection, adapters)
    plan, hit = Plan(), set()
    for spec, adapter in adapters.items():
        for scenario in scenarios:
            if adapter.area != scenario.area:
                continue
            case = Case(scenario, spec)
            skip, xfail = _capability_skip(adapter, scenario), None
            for index, e in enumerate(expectations):
                if (e.owner is None or e.owner == adapter.name) and _matches(e.entry, case, adapter.name):
                    hit.add(index)
                    if e.kind == "skip":
                        skip = skip or e.reason
                    elif xfail is None:
                        xfail = e.reason
            if xfail is not None and not skip:
                skip, xfail = on_device_reason(xfail, scenario.device)
            plan.cases.append(Case(scenario, spec, skip=skip, xfail=xfail))
    for index, e in enumerate(expectations):
        if index in hit:
            continue
        if _could_run_here(e.entry, selection, adapters):
            plan.unmatched.append(f"{e.source}: {e.kind} entry {e.entry!r} matches no collected case")
        elif e.owner is None and _named_by_keyword(e.entry, selection, adapters):
            plan.unmatched.append(f"{e.source}: {e.kind} entry {e.entry!r} matches no collected case "
                                  f"(-k {selection.keyword!r} selects it, but profile {selection.profile!r} and the "
                                  "selected world sizes do not hold it: add --profile or --scenario)")
    return plan


@dataclass(frozen=True)
class _Expectation:
    entry: str
    reason: str
    kind: str  # "xfail" | "skip"
    owner: str | None  # a built-in list applies to its adapter only
    source: str  # the file's name, for warnings


def _expectations(selection: Selection, adapters: dict) -> list[_Expectation]:
    files = [(path, "xfail", None) for path in selection.xfail_files]
    files += [(path, "skip", None) for path in selection.skip_files]
    if selection.builtin_xfails:
        for name in dict.fromkeys(a.name for a in adapters.values()):
            path = builtin_xfails(name)
            if path:
                files.append((path, "xfail", name))
    return [_Expectation(entry, reason, kind, owner, os.path.basename(path))
            for path, kind, owner in files for entry, reason in read_expectations(path).items()]


def _capability_skip(adapter, scenario) -> str:
    missing = missing_capabilities(adapter, scenario.requires)
    if missing:
        return f"{adapter.name} lacks capability: {', '.join(c.value for c in missing)}"
    unavailable = hook(adapter, "unavailable")
    reason = missing_part(adapter, scenario) or (unavailable(scenario) if callable(unavailable) else None)
    if not reason and scenario.optimizer not in ENGINE_OPTIMIZERS and "optimizer" in owned(adapter, scenario):
        reason = (f"the engine builds its own optimizer (protocol v2) from a name; {scenario.optimizer!r} is not "
                  f"one it is asked for ({', '.join(ENGINE_OPTIMIZERS)})")
    if not reason:  # the rank loops' own limits (build order, production features), from the adapter's declarations
        from conformance.adapters.feature_support import unsupported

        reason = unsupported(adapter, scenario)
    return f"{adapter.name}: {reason}" if reason else ""


def _matches(entry: str, case: Case, name: str = "") -> bool:
    """A case id, or a pytest node id whose parameter is the case id; the adapter may be named by
    its spec (`pkg.module:factory`, as in the case id) or by its `name` (`my-engine|ddp/...`).
    The scenario matches on every device, or on the one the entry ends in
    ([Note: expectations on every device])."""
    inner = entry.rsplit("[", 1)[-1][:-1] if entry.endswith("]") else entry
    adapter, sep, scenario_id = inner.partition(CASE_SEPARATOR)
    if not sep:
        return False
    base, device = split_device(scenario_id)
    if device is None:
        base = scenario_id
    elif device != case.scenario.device:
        return False
    case_base = split_device(case.scenario.id)[0] if case.scenario.device != "cpu" else case.scenario.id
    return _id_matches(base, case_base) and adapter in {case.adapter_spec, name}


def _id_matches(entry_id: str, scenario_id: str) -> bool:
    """An entry's scenario id against a scenario's: equal, or, where the entry has a `*`, matched
    with `*` standing for any run of characters (and nothing else special: ids hold `[`, `+`, `.`)."""
    if "*" not in entry_id:
        return entry_id == scenario_id
    return re.fullmatch(".*".join(map(re.escape, entry_id.split("*"))), scenario_id) is not None


def _named_by_keyword(entry: str, selection: Selection, adapters: dict) -> bool:
    """Under `-k`, whether the expression selects the case a user's entry names (for a selected
    adapter): the user meant that case to run, so an entry that matched nothing is a warning even
    when its scenario is outside the profile (which `_could_run_here` leaves alone, as it must for
    built-in lists naming every profile's cases).

    The expression is evaluated the way pytest's -k evaluates a test id: a name matches when it is
    a case-insensitive substring of the case id (`spec|scenario`, the spec as given to --adapter).
    """
    if not selection.keyword:
        return False
    from _pytest.mark.expression import Expression  # pytest's own -k grammar

    case = entry.rsplit("[", 1)[-1].rstrip("]") if entry.endswith("]") else entry
    if CASE_SEPARATOR not in case:
        return False
    adapter, scenario_id = case.split(CASE_SEPARATOR, 1)
    specs = {spec: a.name for spec, a in adapters.items()}
    matches = [spec for spec, name in specs.items() if adapter in (spec, name)]
    if not matches or not any(s.id == scenario_id for s in catalogue.all_scenarios()):
        return False
    try:
        expression = Expression.compile(selection.keyword)
    except (SyntaxError, ValueError):
        return False  # pytest itself reports a bad -k expression
    ids = [f"{spec}{CASE_SEPARATOR}{scenario_id}".lower() for spec in matches]  # what pytest's -k sees
    return any(expression.evaluate(_substring_of(i)) for i in ids)


def _substring_of(case_id: str):
    """pytest's -k matcher for one lower-cased case id: a word matches as a case-insensitive substring."""
    return lambda word, *_, **__: word.lower() in case_id


def _could_run_here(entry: str, selection: Selection, adapters: dict | None = None) -> bool:
    """Built-in lists name cases of every profile: only warn for entries this selection could have run.

    Under `--scenario`, an entry for one of the selected scenarios that matched nothing is a
    warning too (a misspelt adapter, say); entries for other scenarios are not.
    """
    case = entry.rsplit("[", 1)[-1].rstrip("]") if entry.endswith("]") else entry
    adapter = case.split(CASE_SEPARATOR, 1)[0] if CASE_SEPARATOR in case else None
    names = {a.name for a in (adapters or {}).values()}
    if adapter and adapter not in selection.specs and adapter not in names:
        return False
    scenario_id, device = split_device(case.split(CASE_SEPARATOR, 1)[-1])
    if device is not None and device != selection.device:
        return False  # an entry for another device
    named = [s for s in catalogue.all_scenarios() if _id_matches(scenario_id, s.id)]
    if not named and "/triples/" in scenario_id:  # a full array's row: built for its own area only
        area = scenario_id.split("/", 1)[0]
        named = [s for s in catalogue.all_scenarios(area) if _id_matches(scenario_id, s.id)]
    if not named:
        return True  # names no scenario at all: a stale entry
    return any(_selected(s, selection) for s in named)


def _selected(scenario, selection: Selection) -> bool:
    if selection.ids:
        return scenario.id in selection.ids
    if selection.areas and scenario.area not in selection.areas:
        return False
    return selection.profile in scenario.profiles and (not selection.world_sizes or scenario.world_size in selection.world_sizes)
