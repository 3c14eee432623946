"""JUnit XML for CI: one `<testsuite name="gradparity">` per run, one `<testcase>` per case.

Why the suite writes its own instead of pytest's `--junitxml`: the torchrun launcher and
`gradparity zoo` have no pytest session, and a CI user must read the same file whichever
front end ran. It is written from the same records as the JSON report, so the two never
disagree, and it says what pytest's cannot:

- `<properties>`: torch, python, backend, device, profile, adapters (with versions), the
  suite's version and git commit, the command line — what a CI dashboard shows beside a run.
- verdicts map onto JUnit's words: `failed` → `<failure>` (type = the failure class),
  `error` (infrastructure) → `<error>`, `xpassed` (a strict xfail that passed) → `<failure>`,
  `skipped` → `<skipped>`, `xfailed` → `<skipped type="xfail">` whose message is the reason it
  is expected and whose text is the error actually seen (so a changed failure is visible); a
  case listed as a known intermittent failure (`intermittent:`) says in `<system-out>` which
  outcome this run had, a pass included.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
import xml.etree.ElementTree as ET

from conformance.report.record import intermittent_outcome, one_line

SUITE_NAME = "gradparity"
PROPERTY_KEYS = ("torch", "python", "backend", "device", "profile", "suite_version", "commit", "launcher", "command",
                 "stopped")


def _text(value) -> str:
    """XML 1.0 cannot hold most control characters (rank logs may): replace them."""
    text = "" if value is None else str(value)
    return "".join(c if c in "\t\n\r" or ord(c) >= 0x20 else f"\\x{ord(c):02x}" for c in text)


def _properties(run_info: dict) -> ET.Element:
    props = ET.Element("properties")

    def add(name: str, value) -> None:
        if value not in (None, "", [], {}):
            ET.SubElement(props, "property", name=name, value=_text(value))

    for key in PROPERTY_KEYS:
        value = run_info.get(key)
        add(key, ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else value)
    if run_info.get("dirty"):
        add("commit_dirty", "true")
    add("adapters", ", ".join(run_info.get("adapters") or []))
    for spec, version in sorted((run_info.get("adapter_versions") or {}).items()):
        add(f"adapter_version:{spec}", version)
    return props


def _testcase(r: dict) -> ET.Element:
    case = ET.Element("testcase", classname=f"{SUITE_NAME}.{r.get('area', '')}.{r.get('adapter', '')}",
                      name=r.get("scenario", r.get("case", "")), time=f"{float(r.get('duration_s') or 0):.3f}")
    verdict, message = r.get("verdict"), r.get("message") or ""
    if verdict == "failed":
        ET.SubElement(case, "failure", type=_text(r.get("failure_class") or "failed"),
                      message=_text(one_line(r))).text = _text(message)
    elif verdict == "error":
        ET.SubElement(case, "error", type=_text(r.get("failure_class") or "error"),
                      message=_text(one_line(r))).text = _text(message)
    elif verdict == "xpassed":
        ET.SubElement(case, "failure", type="xpassed",
                      message=_text(f"listed as an expected failure but passed: {r.get('xfail_reason') or message}")
                      ).text = _text(message)
    elif verdict == "xfailed":
        reason = r.get("xfail_reason") or message
        ET.SubElement(case, "skipped", type="xfail", message=_text(f"expected failure: {reason}")).text = _text(
            f"seen: {message}" if message and message != reason else "")
    elif verdict == "skipped":
        ET.SubElement(case, "skipped", type="skip", message=_text(message or "skipped"))
    out = []
    seen = intermittent_outcome(r)
    if seen:  # a pass (or xfail) of an `intermittent:` entry: which outcome this run had, and why it is listed
        out.append(f"{seen}; listed: {r.get('xfail_reason')}")
    if r.get("declared"):
        out.append("declared deviations from torch DDP: " + "; ".join(r["declared"]))
    if out:
        ET.SubElement(case, "system-out").text = _text("\n".join(out))
    return case


def render(results: list[dict], run_info: dict) -> str:
    counts = {v: sum(r.get("verdict") == v for r in results) for v in ("failed", "error", "skipped", "xfailed", "xpassed")}
    suite = ET.Element(
        "testsuite", name=SUITE_NAME, tests=str(len(results)),
        failures=str(counts["failed"] + counts["xpassed"]), errors=str(counts["error"]),
        skipped=str(counts["skipped"] + counts["xfailed"]),
        time=f"{sum(float(r.get('duration_s') or 0) for r in results):.3f}",
        timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), hostname=socket.gethostname(),
    )
    suite.append(_properties(run_info))
    for r in sorted(results, key=lambda r: (r.get("area", ""), r.get("adapter", ""), r.get("scenario", ""))):
        suite.append(_testcase(r))
    root = ET.Element("testsuites", name=SUITE_NAME)
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(path: str, results: list[dict], run_info: dict) -> str:
    """Write the JUnit file for `results` (case records) with `run_info` (`run_info.collect()`)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(render(results, run_info))
    os.replace(tmp, path)  # a reader never sees half a file
    return path
