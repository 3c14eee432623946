"""The pytest plugin: the planned cases become test items, each runs through the case pipeline.

Loaded through the `pytest11` entry point, so `pytest --pyargs conformance.suite --adapter X`
works with no CLI; `gradparity run` is a thin wrapper over the same options
(`conformance.frontends.options`). Everything that is not a suite test is left alone (the options are
inert for other test runs).

What pytest adds is the executor (warm rank pools per pytest process, xdist workers included)
and the output; the rest is shared with `gradparity zoo` and torchrun: `conformance.plan`
decides the cases and their skip/xfail reasons, `conformance.pipeline.run_case` runs and
judges each into a `CaseResult`. The test body turns that result into pytest's outcome; the
report hook ships its one serialized form (`CaseResult.record()`) to the controller in
`user_properties` (the channel xdist carries) where the reports are written.
"""

# ruff: noqa: E402 - the suite check (conformance.frontends.extras) runs before the imports it guards
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from conformance.frontends.extras import require

require("the gradparity pytest plugin (conformance.frontends.plugin)")  # one line, before what it would fail on

import pytest

from conformance.adapters import registry
from conformance.case import Case
from conformance.frontends import options
from conformance.judge.failure import Classified, FailureClass
from conformance.pipeline import CaseResult, PoolExecutor, run_case
from conformance.plan import Plan, Selection, make_plan
from conformance.recording import Recorder
from conformance.validation import UsageError

RECORD_KEY = "gradparity"


def pytest_addoption(parser):
    options.add_to_pytest(parser.getgroup("gradparity", "gradparity conformance suite"))


@dataclass(eq=False)
class Session:
    """Per-process state of a suite run: the plan, the executor and the results."""

    config: object
    selection: Selection
    timeout_scale: float = 1.0
    results: list[dict] = field(default_factory=list)  # on the controller: every case's record
    running: dict[str, CaseResult] = field(default_factory=dict)  # in this process: node id -> result
    stopped: str = ""  # why the run ended before every selected case ran ("" when it did not)
    nothing_checked: str | None = None  # why the run checked nothing it was asked to (report/verdict.py)
    recorder: Recorder | None = None  # --record DIR (conformance.recording): every process adds its cases
    recorded: dict | None = None  # the recording's index, once written (controller)
    _plan: Plan | None = None
    _executor: PoolExecutor | None = None

    @property
    def adapters(self) -> list[str]:
        return list(self.selection.specs)

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = make_plan(self.selection)
        return self._plan

    @property
    def executor(self) -> PoolExecutor:
        if self._executor is None:
            self._executor = PoolExecutor(timeout_scale=self.timeout_scale)
        return self._executor

    def close(self):
        if self._executor is not None:
            self._executor.close()

    def pytest_runtest_logreport(self, report):
        """Collects records on the controller (xdist ships user_properties back to it)."""
        recorded = [value for key, value in report.user_properties if key == RECORD_KEY]
        self.results.extend(recorded)
        if not recorded and report.failed:  # e.g. an xdist worker died mid-case: never a silent gap
            from conformance.report.record import lost_case_record

            lost = lost_case_record(report.nodeid, str(report.longrepr), known={r["case"] for r in self.results})
            if lost is not None:
                self.results.append(lost)

    def pytest_keyboard_interrupt(self, excinfo):
        self.stopped = f"interrupted: {excinfo.typename}: {excinfo.value}".rstrip(": ")

    def pytest_internalerror(self, excrepr, excinfo):
        from conformance.judge.failure import crash_clue, first_line

        self.stopped = f"pytest internal error: {crash_clue(str(excrepr)) or first_line(str(excrepr))}"


def pytest_configure(config):
    try:
        report_dir = None if hasattr(config, "workerinput") else config.getoption("report_dir")
        selection = options.selection(config.option, check_reports=bool(report_dir))
    except (UsageError, registry.AdapterError) as exc:
        pytest.exit(f"gradparity: {exc}", returncode=2)
    if report_dir:
        from conformance.report import start_run

        start_run(report_dir)  # one run per directory: the last one's files go now
    config._gradparity = Session(config, selection, config.getoption("timeout_scale"))
    if config.getoption("record"):
        config._gradparity.recorder = Recorder(config.getoption("record"))
        if not hasattr(config, "workerinput"):
            config._gradparity.recorder.start(_run_info(config, selection.specs))
    config.pluginmanager.register(config._gradparity, "gradparity-session")


def pytest_unconfigure(config):
    session = getattr(config, "_gradparity", None)
    if session is not None:
        session.close()


def pytest_generate_tests(metafunc):
    if "gp_case" not in metafunc.fixturenames:
        return
    area = metafunc.module.AREA
    params = []
    for case in metafunc.config._gradparity.plan.cases:
        if case.scenario.area == area:
            marks = [pytest.mark.skip(reason=case.skip)] if case.skip else []
            params.append(pytest.param(case, id=case.id, marks=marks))
    metafunc.parametrize("gp_case", params)


def pytest_collection_modifyitems(session, config, items):
    gp = getattr(config, "_gradparity", None)
    suite_items = [item for item in items if "gp_case" in getattr(item, "fixturenames", ())]
    if gp is None or not suite_items:
        return
    # An area none of the selected adapters implements has no cases: deselect, don't skip.
    empty = [item for item in suite_items
             if not isinstance(getattr(getattr(item, "callspec", None), "params", {}).get("gp_case"), Case)]
    if empty:
        config.hook.pytest_deselected(items=empty)
        items[:] = [item for item in items if item not in empty]
    if not hasattr(config, "workerinput"):
        for message in gp.plan.unmatched:
            warnings.warn(message, stacklevel=1)


def run_suite_case(request) -> None:
    """The body of every suite test: run the planned case, then say its verdict in pytest's words."""
    case: Case = request.getfixturevalue("gp_case")
    session: Session = request.config._gradparity
    result = session.running[request.node.nodeid] = run_case(case, session.executor, session.recorder)
    if result.verdict == "xfailed":
        pytest.xfail(f"{case.xfail}; seen: {result.failure.line() if result.failure else result.message}")
    if result.verdict == "xpassed":
        pytest.fail(f"[XPASS(strict)] {case.xfail}", pytrace=False)
    if result.verdict in ("failed", "error"):
        pytest.fail(result.message, pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    case = getattr(item, "callspec", None) and item.callspec.params.get("gp_case")
    if not isinstance(case, Case) or report.when not in ("call", "setup") or (report.when == "setup" and report.passed):
        return
    session: Session = item.config._gradparity
    result = session.running.pop(item.nodeid, None)
    if result is None:  # never reached the pipeline: skipped at collection, or pytest itself failed it
        result = _outside_pipeline(case, report, call)
        if session.recorder is not None and result.verdict == "skipped":
            session.recorder.add(result)  # so `gradparity compare` can tell "skipped" from "not in this run"
    if result.verdict == "error":
        # Not the implementation's failure: an `error` (pytest's word for a broken setup).
        report.outcome, report.when = "failed", "setup"
    report.user_properties.append((RECORD_KEY, result.record()))


def _outside_pipeline(case: Case, report, call) -> CaseResult:
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr or "")
        return CaseResult(case, "skipped", reason.removeprefix("Skipped: "))
    if report.passed:
        return CaseResult(case, "passed", duration_s=report.duration)
    # A fixture or hook failed around the case: the harness, not the implementation.
    error = call.excinfo.value if call.excinfo is not None else None
    cause = f"the harness raised {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    why = Classified(FailureClass.INFRASTRUCTURE, cause)
    return CaseResult(case, "error", str(report.longrepr)[-8000:], why, report.duration)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    gp = getattr(config, "_gradparity", None)
    if gp is None or hasattr(config, "workerinput"):
        return
    gp.stopped = gp.stopped or str(session.shouldfail or session.shouldstop or "")
    selected = getattr(session, "testscollected", 0) or 0  # 0 on an xdist controller: unknown there
    if gp.stopped and selected > len(gp.results):
        gp.stopped += f"; {selected - len(gp.results)} of {selected} selected cases have no result"
    if not gp.stopped and session.exitstatus == pytest.ExitCode.OK:
        from conformance.report.verdict import exit_reason

        gp.nothing_checked = exit_reason(gp.results, list(gp.selection.adapters))
        if gp.nothing_checked:  # nothing was shown to conform: not a pass (`gradparity run` exits 2)
            session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
    report_dir = config.getoption("report_dir")
    if gp.recorder is not None:
        gp.recorded = gp.recorder.finish(_run_info(config, gp.adapters), stopped=gp.stopped or None)
    if report_dir and gp.results:
        from conformance.report import write_reports

        info = _run_info(config, gp.adapters)
        info["stopped"] = gp.stopped or None
        info["nothing_checked"] = gp.nothing_checked
        config._gradparity_written = write_reports(report_dir, gp.results, adapters=gp.adapters, config=config,
                                                   run_info=info)


def _run_info(config, adapters) -> dict:
    from conformance.report import run_info

    return run_info.collect(profile=config.getoption("profile"), device=config.getoption("device"),
                            adapters=list(adapters))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    gp = getattr(config, "_gradparity", None)
    if gp is None or not (gp.results or gp.stopped):
        return
    from conformance.report.terminal import print_summary

    print_summary(terminalreporter, gp.results, getattr(config, "_gradparity_written", None), gp.plan.unmatched,
                  stopped=gp.stopped, exit_reason=gp.nothing_checked)
    if gp.recorded is not None:
        terminalreporter.write_line(f"recording: {gp.recorder.directory} ({len(gp.recorded['case_files'])} cases, "
                                    f"{gp.recorded['bytes'] / 1e6:.1f} MB, {gp.recorded['record_seconds_this_process']:.1f} s spent "
                                    "recording in this process); compare two with `gradparity compare BASE NEW`")


@pytest.fixture
def gradparity_check(request):
    """`check_model` for a test of your own model (docs/your-model.md):

        def test_my_model_trains_like_one_process(gradparity_check):
            result = gradparity_check(my_model.build, my_model.batch, loss=my_model.loss)
            assert result.ok, result.summary

    Adapters and world sizes come from `--adapter`/`--world-size` when given (else torch-ddp and
    refimpl-ddp at 2 ranks); the cases run on this pytest process's warm rank pools."""
    from conformance.frontends import model_check

    session: Session = request.config._gradparity

    def check(build, batch, loss=None, **kwargs):
        kwargs.setdefault("adapters", session.selection.adapters or model_check.DEFAULT_ADAPTERS)
        kwargs.setdefault("world_sizes", session.selection.world_sizes or (2,))
        return model_check.check_model(build, batch, loss, executor=session.executor, **kwargs)

    return check
