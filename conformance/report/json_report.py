"""The JSON report: one document per run, with a `schema` version and full provenance."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from collections import Counter

from conformance.report.verdict import adapter_verdicts

# 2: every non-pass carries `failure_class` and a one-line `cause`.
# 3: provenance (`run.command`, `run.launcher`, `suite.commit`, `run_info`); an xfailed case's
#    `message` is the error actually seen and `xfail_reason` why it is expected. A `passed` case
#    with an `xfail_reason` is listed as a known intermittent failure (`intermittent:`, see
#    conformance.expectations) that did not happen in this run; readers of `verdict` alone see a pass.
#    (Added within 3: each adapter's `verdict` (report/verdict.py: `nothing checked` when every case
#    was skipped), `summary.verdicts`, `run.nothing_checked`; `summary.failure_classes` counts
#    failures only, `summary.expected_failure_classes` the expected failures'.)
SCHEMA = "gradparity.report/3"
VERDICTS = ("passed", "failed", "xfailed", "xpassed", "skipped", "error")
FAILURE_CLASSES = ("wrong value", "raised", "crashed", "hung", "infrastructure")


def _adapter_info(spec: str) -> dict:
    from conformance.adapters import registry
    from conformance.report.run_info import adapter_version

    try:
        adapter = registry.load(spec)
        semantics = getattr(adapter, "semantics", None)
        return {"spec": spec, "name": adapter.name, "version": adapter_version(spec, adapter),
                "area": adapter.area, "capabilities": sorted(c.value for c in adapter.capabilities),
                "owns": sorted(getattr(adapter, "owns", ()) or ()),
                "semantics": semantics.deviations() if semantics is not None else [],
                "semantics_sources": list(semantics.sources) if semantics is not None else []}
    except Exception as exc:  # the report must still be written
        return {"spec": spec, "name": spec, "version": "unknown", "error": str(exc)}


def build_report(results: list[dict], *, adapters: list[str], config=None, profile: str | None = None,
                 run_info: dict | None = None) -> dict:
    """The report document. `run_info` (`run_info.collect()`) is collected here when not given;
    its backend/device/profile are filled from the results where the front end left them out."""
    import torch

    from conformance.report import run_info as provenance

    option = (lambda name, default=None: config.getoption(name)) if config is not None else (lambda name, default=None: default)
    devices = sorted({r["device"] for r in results})
    counts = Counter(r["verdict"] for r in results)
    classes = Counter(r.get("failure_class") for r in results if r["verdict"] in ("failed", "error"))
    expected_classes = Counter(r.get("failure_class") for r in results if r["verdict"] == "xfailed")
    backends = sorted({"gloo" if d == "cpu" else ("nccl" if torch.cuda.device_count() > 1 else "gloo") for d in devices})
    info = dict(run_info) if run_info is not None else provenance.collect(adapters=adapters)
    # One profile for the whole document: the caller's, else the front end's run_info, else pytest's option.
    profile = profile or info.get("profile") or option("profile", "quick")
    info["profile"] = profile
    info["backend"] = info.get("backend") or ", ".join(backends)
    info["device"] = info.get("device") or ", ".join(devices)
    info.setdefault("adapters", list(adapters))
    suite = provenance.suite_provenance()
    verdicts = adapter_verdicts(results, stopped=bool(info.get("stopped")))
    return {
        "schema": SCHEMA,
        "suite": {"name": "gradparity", "version": suite["version"], "commit": info.get("commit", suite["commit"]),
                  "commit_source": info.get("commit_source", suite["commit_source"]), "dirty": info.get("dirty", suite["dirty"])},
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cuda_available": torch.cuda.is_available(),
        },
        "run": {
            "command": info.get("command"),
            "launcher": info.get("launcher"),
            "stopped": info.get("stopped"),  # why the run ended before every case ran; None when it did not
            "nothing_checked": info.get("nothing_checked"),  # why it exits 2: no case (of a named adapter) ran
            "profile": profile,
            "device": devices,
            "backends": backends,
            "world_sizes": sorted({r["world_size"] for r in results}),
            "seeds": sorted({r["seed"] for r in results}),
        },
        "run_info": info,
        "adapters": [_adapter_info(spec) | {"verdict": verdicts.get(spec, "not run")} for spec in adapters],
        "summary": {v: counts.get(v, 0) for v in VERDICTS} | {"total": len(results)}
        | {"failure_classes": {c: classes.get(c, 0) for c in FAILURE_CLASSES}}
        | {"expected_failure_classes": {c: expected_classes.get(c, 0) for c in FAILURE_CLASSES}}
        | {"verdicts": verdicts},
        "results": sorted(results, key=lambda r: (r["adapter"], r["scenario"])),
        "coverage": _coverage(profile, adapters),
    }


def _coverage(profile: str, adapters: list[str]) -> list[dict]:
    """Per adapter and area with a generated space: feature pairs covered / possible (issue 38),
    uncovered pairs with the reason (`conformance.coverage`)."""
    from conformance import coverage

    return [r for r in coverage.per_adapter(profile, tuple(adapters)) if "error" not in r]


def write_json(path: str, report: dict) -> str:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:  # the report holds non-ASCII (◆, µs): never the locale's codec
        json.dump(report, fh, indent=2, default=str)
    os.replace(tmp, path)  # a reader never sees half a report
    return path
