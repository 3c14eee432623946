"""The pytest plugin: turns catalogue × adapters into test cases, runs them, and reports.

Loaded through the `pytest11` entry point, so `pytest --pyargs conformance.suite --adapter X`
works with no CLI; `gradparity run` is a thin wrapper over the same options. Everything that
is not a suite test is left alone (the options are inert for other test runs).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import pytest

from conformance import catalogue
from conformance.adapters import registry
from conformance.adapters.protocol import missing_capabilities
from conformance.expectations import builtin_xfails, read_expectations
from conformance.failure import FailureClass, classify_exception
from conformance.report.record import CASE_SEPARATOR, case_id, case_record
from conformance.validation import (
    UsageError,
    check_expectations_file,
    check_profile,
    check_report_dir,
    check_world_sizes,
)


def pytest_addoption(parser):
    group = parser.getgroup("gradparity", "gradparity conformance suite")
    group.addoption("--adapter", action="append", default=[], help="adapter name or pkg.module:factory (repeatable)")
    group.addoption("--ddp-class", action="append", default=[], help="pkg.module:Class with torch DDP's constructor")
    group.addoption("--profile", default="quick", help="scenario profile: quick, standard or full")
    group.addoption("--scenario", action="append", default=[], help="run exactly this scenario id (repeatable)")
    group.addoption("--world-size", action="append", type=int, default=[], help="only these world sizes")
    group.addoption("--device", default="cpu", help="cpu or cuda")
    group.addoption("--xfails", action="append", default=[], help="file of expected failures (case or node ids, # comments)")
    group.addoption("--skips", action="append", default=[], help="file of cases to skip (case or node ids, # comments)")
    group.addoption("--gradparity-report-dir", default=None, help="write JSON and HTML reports here")
    group.addoption("--timeout-scale", type=float, default=1.0, help="multiply every scenario's timeout")


@dataclass(eq=False)
class Session:
    """Per-process state of a suite run: warm pools and collected results."""

    config: object
    adapters: list[str]
    timeout_scale: float = 1.0
    results: list[dict] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    stopped: str = ""  # why the run ended before every selected case ran ("" when it did not)
    _pools: object = None

    @property
    def pools(self):
        if self._pools is None:
            from conformance.harness.pool import PoolManager

            self._pools = PoolManager()
        return self._pools

    def close(self):
        if self._pools is not None:
            self._pools.close()

    def pytest_runtest_logreport(self, report):
        """Collects results on the controller (xdist ships user_properties back to it)."""
        recorded = [value for key, value in report.user_properties if key == "gradparity"]
        self.results.extend(recorded)
        if not recorded and report.failed:  # e.g. an xdist worker died mid-case: never a silent gap
            from conformance.report.record import lost_case_record

            lost = lost_case_record(report.nodeid, str(report.longrepr), known={r["case"] for r in self.results})
            if lost is not None:
                self.results.append(lost)

    def pytest_keyboard_interrupt(self, excinfo):
        self.stopped = f"interrupted: {excinfo.typename}: {excinfo.value}".rstrip(": ")

    def pytest_internalerror(self, excrepr, excinfo):
        from conformance.failure import crash_clue, first_line

        self.stopped = f"pytest internal error: {crash_clue(str(excrepr)) or first_line(str(excrepr))}"


def _adapter_specs(config) -> list[str]:
    specs = list(config.getoption("adapter") or [])
    specs += [registry.ddp_class_spec(ref) for ref in config.getoption("ddp_class") or []]
    return specs or list(registry.DEFAULT_ADAPTERS)


def _usage_error(message: str):
    pytest.exit(f"gradparity: {message}", returncode=2)


def pytest_configure(config):
    specs = _adapter_specs(config)
    try:
        check_profile(config.getoption("profile"))
        device = config.getoption("device")
        if device not in ("cpu", "cuda"):
            raise UsageError(f"unknown device {device!r}; use cpu or cuda")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise UsageError("--device cuda but torch.cuda.is_available() is False; run on a GPU machine or use --device cpu")
        adapters = {}
        for spec in specs:
            try:
                adapters[spec] = registry.load(spec)
            except registry.AdapterError as exc:
                raise UsageError(str(exc)) from None
        check_world_sizes(config.getoption("profile"), config.getoption("world_size"), adapters, device,
                          ids=config.getoption("scenario"))
        for path in config.getoption("xfails") + config.getoption("skips"):
            check_expectations_file(path)
        if config.getoption("gradparity_report_dir") and not hasattr(config, "workerinput"):
            check_report_dir(config.getoption("gradparity_report_dir"))
            from conformance.report import start_run

            start_run(config.getoption("gradparity_report_dir"))  # one run per directory: the last one's files go now
    except UsageError as exc:
        _usage_error(str(exc))
    config._gradparity = Session(config, specs, config.getoption("timeout_scale"))
    config.pluginmanager.register(config._gradparity, "gradparity-session")


def pytest_unconfigure(config):
    session = getattr(config, "_gradparity", None)
    if session is not None:
        session.close()


def pytest_generate_tests(metafunc):
    if "gp_case" not in metafunc.fixturenames:
        return
    config = metafunc.config
    area = metafunc.module.AREA
    world_sizes = config.getoption("world_size")
    scenarios = catalogue.select(
        area=area, profile=config.getoption("profile"), world_sizes=world_sizes,
        device=config.getoption("device"), ids=config.getoption("scenario"),
    )
    params = []
    for spec in config._gradparity.adapters:
        adapter = registry.load(spec)
        if adapter.area != area:
            continue
        for scenario in scenarios:
            marks = []
            missing = missing_capabilities(adapter, scenario.requires)
            if missing:
                names = ", ".join(c.value for c in missing)
                marks.append(pytest.mark.skip(reason=f"{adapter.name} lacks capability: {names}"))
            unavailable = getattr(adapter, "unavailable", None)
            reason = unavailable(scenario) if callable(unavailable) else None
            if reason:
                marks.append(pytest.mark.skip(reason=f"{adapter.name}: {reason}"))
            params.append(pytest.param((spec, scenario), id=case_id(spec, scenario), marks=marks))
    metafunc.parametrize("gp_case", params)


def _matches(entry: str, item) -> bool:
    return item.nodeid == entry or item.nodeid.endswith(entry) or item.nodeid.endswith(f"[{entry}]")


def pytest_collection_modifyitems(session, config, items):
    gp = getattr(config, "_gradparity", None)
    suite_items = [item for item in items if "gp_case" in getattr(item, "fixturenames", ())]
    if gp is None or not suite_items:
        return
    # An area none of the selected adapters implements has no cases: deselect, don't skip.
    empty = [
        item for item in suite_items
        if not isinstance(getattr(getattr(item, "callspec", None), "params", {}).get("gp_case"), tuple)
    ]
    if empty:
        config.hook.pytest_deselected(items=empty)
        items[:] = [item for item in items if item not in empty]
        suite_items = [item for item in suite_items if item not in empty]
    files = [(p, "xfail") for p in config.getoption("xfails")] + [(p, "skip") for p in config.getoption("skips")]
    for spec in gp.adapters:
        name = registry.load(spec).name
        builtin = builtin_xfails(name)
        if builtin:
            files.append((builtin, "xfail"))
    for path, kind in files:
        for entry, reason in read_expectations(path).items():
            hits = [item for item in suite_items if _matches(entry, item)]
            for item in hits:
                mark = pytest.mark.xfail(reason=reason, strict=True) if kind == "xfail" else pytest.mark.skip(reason=reason)
                item.add_marker(mark)
            if not hits and _could_run_here(entry, gp):
                message = f"{os.path.basename(path)}: {kind} entry {entry!r} matches no collected case"
                gp.unmatched.append(message)
                warnings.warn(message, stacklevel=1)


def _could_run_here(entry: str, gp: Session) -> bool:
    """Built-in xfail lists name cases of every profile: only warn for ones this run selected."""
    adapter = entry.split(CASE_SEPARATOR, 1)[0] if CASE_SEPARATOR in entry else None
    if adapter and adapter not in gp.adapters:
        return False
    scenario_id = entry.split(CASE_SEPARATOR, 1)[-1].rstrip("]")
    known = {s.id for s in catalogue.all_scenarios()}
    if scenario_id in known:
        profile = gp.config.getoption("profile")
        scenario = next(s for s in catalogue.all_scenarios() if s.id == scenario_id)
        sizes = gp.config.getoption("world_size")
        return profile in scenario.profiles and (not sizes or scenario.world_size in sizes) and not gp.config.getoption("scenario")
    return True


def run_case(request, area: str) -> None:
    """The body of every suite test: run the case through its area's driver."""
    spec, scenario = request.getfixturevalue("gp_case")
    session = request.config._gradparity
    request.node._gp_checked = catalogue.driver(area).check(scenario, spec, session)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    case = getattr(item, "callspec", None) and item.callspec.params.get("gp_case")
    if not isinstance(case, tuple) or report.when not in ("call", "setup") or (report.when == "setup" and report.passed):
        return
    spec, scenario = case
    # A pass leaves its Checked on the item; a contract failure carries the ranks' details.
    details = getattr(item, "_gp_checked", None) or (call.excinfo.value if call.excinfo is not None else None)
    failure = _classify(report, call)
    if failure is not None and failure.failure_class is FailureClass.INFRASTRUCTURE:
        # Not the implementation's failure: an `error` (pytest's word for a broken setup), never
        # a failure and never an expected failure either.
        report.outcome, report.when = "failed", "setup"
        if hasattr(report, "wasxfail"):
            del report.wasxfail
    verdict = report.outcome
    if hasattr(report, "wasxfail"):
        verdict = "xfailed" if report.skipped else "xpassed"
    elif report.skipped:
        verdict = "skipped"
    elif failure is not None:
        verdict = failure.failure_class.verdict
    elif report.failed and "XPASS(strict)" in str(report.longrepr):
        verdict = "xpassed"
    message, xfail_reason = "", getattr(report, "wasxfail", "") or _strict_xpass_reason(item)
    if report.failed or (verdict == "xfailed" and call.excinfo is not None):
        message = _short_failure(report, call)  # for an xfail: the error actually seen, beside its reason
    elif report.skipped:
        message = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
    record = case_record(spec, scenario, verdict=verdict, message=message, duration_s=report.duration, checked=details,
                         failure=failure, xfail_reason=xfail_reason if verdict in ("xfailed", "xpassed") else "")
    report.user_properties.append(("gradparity", record))


def _strict_xpass_reason(item) -> str:
    mark = item.get_closest_marker("xfail")
    return str(mark.kwargs.get("reason", "")) if mark is not None else ""


def _classify(report, call):
    """The failure class of a failed (or expectedly failed) case; None for passes and skips."""
    excinfo = call.excinfo
    if excinfo is None or not (report.failed or hasattr(report, "wasxfail")):
        return None
    if isinstance(excinfo.value, (pytest.skip.Exception, pytest.xfail.Exception)):
        return None
    return classify_exception(excinfo.value)


def _short_failure(report, call) -> str:
    """The contract's own message when there is one (it is complete); else pytest's text."""
    excinfo = call.excinfo
    if excinfo is not None and isinstance(excinfo.value, AssertionError) and str(excinfo.value).startswith("["):
        return str(excinfo.value)
    return str(report.longrepr)[-8000:]


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    gp = getattr(config, "_gradparity", None)
    if gp is None or hasattr(config, "workerinput"):
        return
    gp.stopped = gp.stopped or str(session.shouldfail or session.shouldstop or "")
    selected = getattr(session, "testscollected", 0) or 0  # 0 on an xdist controller: unknown there
    if gp.stopped and selected > len(gp.results):
        gp.stopped += f"; {selected - len(gp.results)} of {selected} selected cases have no result"
    report_dir = config.getoption("gradparity_report_dir")
    if report_dir and gp.results:
        from conformance.report import run_info, write_reports

        info = run_info.collect(profile=config.getoption("profile"), device=config.getoption("device"), adapters=gp.adapters)
        info["stopped"] = gp.stopped or None
        config._gradparity_written = write_reports(report_dir, gp.results, adapters=gp.adapters, config=config,
                                                   run_info=info)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    gp = getattr(config, "_gradparity", None)
    if gp is None or not (gp.results or gp.stopped):
        return
    from conformance.report.terminal import print_summary

    print_summary(terminalreporter, gp.results, getattr(config, "_gradparity_written", None), gp.unmatched,
                  stopped=gp.stopped)
