"""Reports: versioned JSON (machine-readable provenance), JUnit XML (CI), HTML (people), terminal.

A report directory holds ONE run. The suite owns a fixed set of file names in it (RUN_FILES);
`start_run` removes them when a run starts (so a run that dies before writing cannot leave the
previous run's verdicts looking current) and `write_reports` writes every one of them, each
through a temporary file and a rename. Files the suite did not write are never touched: the
directory may be `.` or hold a user's own files, and `gradparity zoo` writes its own reports in a
sub-directory of the default one — so the directory is cleaned by name, not swapped wholesale.
"""

from __future__ import annotations

import os

from conformance.report.html import write_html
from conformance.report.json_report import build_report, write_json
from conformance.report.junit import write_junit

JSON, HTML, JUNIT = "gradparity.json", "gradparity.html", "junit.xml"
RUN_FILES = (JSON, HTML, JUNIT)


def start_run(report_dir: str, names: tuple[str, ...] = RUN_FILES) -> list[str]:
    """Remove the previous run's report files (only those, by name); returns what was removed."""
    removed = []
    for name in names:
        path = os.path.join(report_dir, name)
        if os.path.isfile(path) or os.path.islink(path):
            try:
                os.remove(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def write_reports(report_dir: str, results: list[dict], *, adapters: list[str], config=None, profile: str | None = None,
                  run_info: dict | None = None) -> dict[str, str]:
    """Write gradparity.json, gradparity.html and junit.xml for one run; returns {kind: path}.

    `run_info` is `conformance.report.run_info.collect(...)` (collected here when not given).
    """
    os.makedirs(report_dir, exist_ok=True)
    report = build_report(results, adapters=adapters, config=config, profile=profile, run_info=run_info)
    return {
        "json": write_json(os.path.join(report_dir, JSON), report),
        "html": write_html(os.path.join(report_dir, HTML), report),
        "junit": write_junit(os.path.join(report_dir, JUNIT), report["results"], report["run_info"]),
    }
