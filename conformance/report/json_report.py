"""The JSON report: one document per run, with a `schema` version and full provenance."""

from __future__ import annotations

import datetime as _dt
import json
import platform
from collections import Counter

SCHEMA = "gradparity.report/2"  # 2: every non-pass carries `failure_class` and a one-line `cause`
VERDICTS = ("passed", "failed", "xfailed", "xpassed", "skipped", "error")
FAILURE_CLASSES = ("wrong value", "raised", "crashed", "hung", "infrastructure")


def _adapter_info(spec: str) -> dict:
    from conformance.adapters import registry

    try:
        adapter = registry.load(spec)
        semantics = getattr(adapter, "semantics", None)
        return {"spec": spec, "name": adapter.name, "version": str(getattr(adapter, "version", "unknown")),
                "area": adapter.area, "capabilities": sorted(c.value for c in adapter.capabilities),
                "owns": sorted(getattr(adapter, "owns", ()) or ()),
                "semantics": semantics.deviations() if semantics is not None else [],
                "semantics_sources": list(semantics.sources) if semantics is not None else []}
    except Exception as exc:  # the report must still be written
        return {"spec": spec, "name": spec, "version": "unknown", "error": str(exc)}


def build_report(results: list[dict], *, adapters: list[str], config=None, profile: str | None = None) -> dict:
    import torch

    import conformance

    option = (lambda name, default=None: config.getoption(name)) if config is not None else (lambda name, default=None: default)
    devices = sorted({r["device"] for r in results})
    counts = Counter(r["verdict"] for r in results)
    classes = Counter(r.get("failure_class") for r in results if r["verdict"] in ("failed", "error", "xfailed"))
    backends = sorted({"gloo" if d == "cpu" else ("nccl" if torch.cuda.device_count() > 1 else "gloo") for d in devices})
    return {
        "schema": SCHEMA,
        "suite": {"name": "gradparity", "version": conformance.__version__},
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cuda_available": torch.cuda.is_available(),
        },
        "run": {
            "profile": profile or option("profile", "quick"),
            "device": devices,
            "backends": backends,
            "world_sizes": sorted({r["world_size"] for r in results}),
            "seeds": sorted({r["seed"] for r in results}),
        },
        "adapters": [_adapter_info(spec) for spec in adapters],
        "summary": {v: counts.get(v, 0) for v in VERDICTS} | {"total": len(results)}
        | {"failure_classes": {c: classes.get(c, 0) for c in FAILURE_CLASSES}},
        "results": sorted(results, key=lambda r: (r["adapter"], r["scenario"])),
    }


def write_json(path: str, report: dict) -> str:
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    return path
