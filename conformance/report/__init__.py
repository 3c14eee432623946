"""Reports: versioned JSON (machine-readable provenance), HTML (for people), terminal summary.

JUnit XML comes from pytest's own `--junitxml`, which `gradparity run` always passes.
"""

from __future__ import annotations

import os

from conformance.report.html import write_html
from conformance.report.json_report import build_report, write_json


def write_reports(report_dir: str, results: list[dict], *, adapters: list[str], config=None, profile: str | None = None) -> dict[str, str]:
    os.makedirs(report_dir, exist_ok=True)
    report = build_report(results, adapters=adapters, config=config, profile=profile)
    paths = {
        "json": write_json(os.path.join(report_dir, "gradparity.json"), report),
        "html": write_html(os.path.join(report_dir, "gradparity.html"), report),
    }
    junit = getattr(getattr(config, "option", None), "xmlpath", None) if config else None
    if junit:
        paths["junit"] = junit
    return paths
