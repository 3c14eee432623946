"""The HTML report: one self-contained page people look at.

Provenance (command, commit, torch, adapters with versions), an adapter × scenario matrix per
area (colour = verdict; every xfail and skip reason written out under its table, not only in a
tooltip), every expected failure with the reason it is expected beside the error actually seen,
every failure in full with, where values left their rule, the module × event picture of how far
(divergence_html.py), upstream issues as links (links.py), and one bucket timeline per adapter
(timeline.py).
"""

from __future__ import annotations

import html
import os
from collections import defaultdict

from conformance.report.divergence_html import CSS as DIVERGENCE_CSS
from conformance.report.divergence_html import for_result as divergence_picture
from conformance.report.links import linkify
from conformance.report.record import intermittent_outcome, one_line
from conformance.report.timeline import section as timelines_section
from conformance.report.verdict import (
    CONFORMANT,
    INCOMPLETE,
    NO_VERDICT,
    NOT_CONFORMANT,
    NOTHING_CHECKED,
    adapter_verdict,
    nothing_checked,
)

COLOURS = {
    "passed": "#2e7d32", "failed": "#c62828", "xfailed": "#f9a825", "xpassed": "#8e24aa",
    "skipped": "#9e9e9e", "error": "#c62828",
}
# An adapter's verdict: nothing checked is grey like a skip, never the green of a pass.
VERDICT_COLOURS = {CONFORMANT: COLOURS["passed"], NOT_CONFORMANT: COLOURS["failed"], NO_VERDICT: COLOURS["failed"],
                   INCOMPLETE: COLOURS["xfailed"], NOTHING_CHECKED: COLOURS["skipped"]}
SYMBOL = {"passed": "✓", "failed": "✗", "xfailed": "x", "xpassed": "!", "skipped": "–", "error": "E"}

CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:left}
th{background:#f5f5f5;position:sticky;top:0}
td.v{text-align:center;color:#fff;font-weight:bold;min-width:5em}
pre{background:#fafafa;border:1px solid #eee;padding:8px;white-space:pre-wrap;font-size:12px}
.meta td{border:none;padding:1px 8px}
.legend span{display:inline-block;padding:2px 8px;margin-right:6px;color:#fff;border-radius:3px}
td.v sup a,ol.reasons a{color:inherit}
ol.reasons{font-size:13px;margin-top:4px}
ul.timelines{list-style:none;padding-left:0}
"""


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _matrices(report: dict) -> str:
    """One matrix per area, with only the adapters that ran there (no columns of n/a)."""
    by_area: dict[str, list[dict]] = defaultdict(list)
    for r in report["results"]:
        by_area[r["area"]].append(r)
    parts = []
    for area in sorted(by_area):
        results = by_area[area]
        adapters = [a["spec"] for a in report["adapters"] if any(r["adapter"] == a["spec"] for r in results)]
        counts = defaultdict(int)
        for r in results:
            counts[r["verdict"]] += 1
        tally = ", ".join(f"{v} {n}" for v, n in sorted(counts.items()))
        parts.append(f"<h3>{_e(area)} <small>({len(results)} cases: {_e(tally)})</small></h3>" + _matrix(results, adapters, area))
    return "".join(parts)


def _reason(r: dict) -> str:
    """Why a case did not run (skip) or is expected to fail (xfail, or a pass of a case listed as a
    known intermittent failure); "" for other verdicts."""
    if r["verdict"] == "skipped":
        return f"skipped: {r.get('message') or 'no reason given'}"
    if r["verdict"] == "xfailed":
        return f"expected failure: {r.get('xfail_reason') or r.get('message') or 'no reason given'}"
    if intermittent_outcome(r):  # a pass of an `intermittent:` entry is footnoted with it, never silent
        return f"{intermittent_outcome(r)}; listed: {r.get('xfail_reason')}"
    return ""


def _matrix(results: list[dict], adapters: list[str], area: str = "") -> str:
    cells: dict[str, dict[str, dict]] = defaultdict(dict)
    meta: dict[str, dict] = {}
    for r in results:
        cells[r["scenario"]][r["adapter"]] = r
        meta[r["scenario"]] = r
    reasons: dict[str, int] = {}  # every distinct skip/xfail reason, numbered, written out under the table
    rows = []
    for scenario in sorted(cells):
        m = meta[scenario]
        tds = []
        for adapter in adapters:
            r = cells[scenario].get(adapter)
            if r is None:
                tds.append('<td class="v" style="background:#eee;color:#999">n/a</td>')
                continue
            first = one_line(r)
            anchor = f' href="#f-{_e(r["case"])}"' if r["verdict"] in ("failed", "error", "xpassed", "xfailed") else ""
            declared = r.get("declared") or []
            if declared:  # the verdict holds under these declared deviations from torch DDP
                first += " | declared: " + "; ".join(declared)
            oracle = (r.get("details") or {}).get("oracle")
            if oracle:  # which rule judged it, the widest envelope, the straight-through check
                first += (f" | rule: {oracle['rule']}; widest envelope {oracle['largest_bound_u']:.3g}·u·Σ|x_i|"
                          f"; straight through: {oracle.get('straight_through', 'not run')}"
                          + (f"; 1/W matched: {oracle['placement_matched']}" if oracle.get("placement_matched") else ""))
            mark = " ◆" if declared else ""
            note = ""
            reason = _reason(r)
            if reason:
                number = reasons.setdefault(reason, len(reasons) + 1)
                note = f'<sup><a href="#r-{_e(area)}-{number}">[{number}]</a></sup>'
            tds.append(
                f'<td class="v" style="background:{COLOURS.get(r["verdict"], "#555")}" title="{_e(first)}">'
                f'<a style="color:#fff"{anchor}>{SYMBOL.get(r["verdict"], "?")} {_e(r["verdict"])}{mark}</a>{note}</td>'
            )
        upstream = f" <small>({linkify(m['upstream'])})</small>" if m.get("upstream") else ""
        rows.append(
            f"<tr><td><code>{_e(scenario)}</code>{upstream}<br><small>{_e(m['options'])}; tolerance {_e(m['tolerance'])}</small></td>"
            + "".join(tds) + "</tr>"
        )
    head = "".join(f"<th>{_e(a)}</th>" for a in adapters)
    notes = "".join(f'<li id="r-{_e(area)}-{n}" value="{n}">{linkify(reason)}</li>' for reason, n in reasons.items())
    return (f"<table><tr><th>scenario</th>{head}</tr>{''.join(rows)}</table>"
            + (f'<ol class="reasons">{notes}</ol>' if notes else ""))


def _compatibility(report: dict) -> str:
    """Engines × scenario groups (passed ✓ / failed ✗ / xfailed x), with declared semantics."""
    from conformance.report.matrix import VERDICTS, cell_text, tally

    groups, cells = tally(report["results"])
    if not groups:
        return ""
    info = {a["spec"]: a for a in report["adapters"]}
    rows = []
    for adapter in sorted(cells):
        totals = sum((cells[adapter][g] for g in groups), start=type(cells[adapter][groups[0]])())
        verdict = adapter_verdict(totals, stopped=bool(report["run"].get("stopped")))
        colour = VERDICT_COLOURS[verdict] if verdict != CONFORMANT or not totals["xfailed"] else COLOURS["xfailed"]
        declared = "; ".join(info.get(adapter, {}).get("semantics") or []) or "torch DDP semantics"
        tds = "".join(f"<td>{_e(cell_text(cells[adapter][g]))}</td>" for g in groups)
        summary = ", ".join(f"{totals[v]} {v}" for v in VERDICTS if totals[v])
        rows.append(
            f'<tr><td><b>{_e(adapter)}</b> {_e(info.get(adapter, {}).get("version", ""))}<br><small>{_e(declared)}</small></td>'
            f'{tds}<td style="color:{colour}"><b>{_e(verdict)}</b><br>{_e(summary)}</td></tr>'
        )
    head = "".join(f"<th>{_e(g)}</th>" for g in groups)
    return (
        "<h2>Compatibility matrix</h2><p><small>per scenario group: ✓ passed, ✗ failed, x expected failure "
        "(strict, with its upstream reference), ! unexpectedly passed, – skipped; ◆ in a cell below marks a "
        "verdict under declared semantics (hover for them)</small></p>"
        f"<table><tr><th>adapter</th>{head}<th>total</th></tr>{''.join(rows)}</table>"
    )


def _expected(report: dict) -> str:
    """Each xfailed case: why it is expected (its xfail entry, linked upstream) beside what was seen."""
    rows = "".join(
        f'<tr id="f-{_e(r["case"])}"><td><code>{_e(r["case"])}</code></td>'
        f"<td>{linkify(r.get('xfail_reason') or '')}</td>"
        f"<td>{_e(one_line(r))}<details><summary>full error</summary><pre>{_e(r.get('message') or '')}</pre></details></td></tr>"
        for r in report["results"] if r["verdict"] == "xfailed"
    )
    if not rows:
        return ""
    return ("<h2>Expected failures</h2><p><small>strict: a listed case that passes fails the run; compare the error "
            "seen with the reason to spot a case that now fails for another cause</small></p>"
            f"<table><tr><th>case</th><th>expected because</th><th>seen</th></tr>{rows}</table>")


def _coverage(report: dict) -> str:
    """Pair coverage per adapter and area (issue 38): covered / possible, then what is uncovered and why."""
    records = report.get("coverage") or []
    if not records:
        return ""
    rows = "".join(f"<tr><td>{_e(r['adapter'])}</td><td>{_e(r['area'])}</td><td>{r['covered']}/{r['possible']}</td>"
                   f"<td>{r['excluded']}</td></tr>" for r in records)
    missing = "".join(f"<li>{_e(r['adapter'])} {_e(r['area'])}: "
                      f"{_e(', '.join(f'{k}={v}' for k, v in u['pair'].items()))}: {_e(u['why'])}</li>"
                      for r in records for u in r["uncovered"][:50])
    return (f"<h2>Pair coverage (profile {_e(report['run']['profile'])})</h2><table><tr><th>adapter</th><th>area</th>"
            f"<th>pairs covered / possible</th><th>excluded by constraints</th></tr>{rows}</table>"
            + (f"<details><summary>uncovered pairs (first 50 per adapter)</summary><ul>{missing}</ul></details>"
               if missing else ""))


def render(report: dict) -> str:
    s = report["summary"]
    env, run = report["environment"], report["run"]
    adapters = "".join(
        f"<tr><td>{_e(a['spec'])}</td><td>{_e(a.get('name'))}</td><td>{_e(a.get('version'))}</td><td>{_e(a.get('area', ''))}</td>"
        f"<td>{_e(', '.join(a.get('owns') or []) or '-')}</td>"
        f"<td style=\"color:{VERDICT_COLOURS.get(a.get('verdict'), '#555')}\"><b>{_e(a.get('verdict', ''))}</b></td>"
        f"<td>{_e('; '.join(a.get('semantics') or []) or 'torch DDP semantics')}"
        f"{''.join(f'<br><small>{_e(src)}</small>' for src in a.get('semantics_sources') or [])}</td></tr>"
        for a in report["adapters"]
    )
    legend = "".join(f'<span style="background:{c}">{v}: {s.get(v, 0)}</span>' for v, c in COLOURS.items())
    failures = "".join(
        f'<h3 id="f-{_e(r["case"])}">{_e(r["case"])} — {_e(r["verdict"])}'
        + (f' ({_e(r["failure_class"])})' if r.get("failure_class") else "")
        + f'</h3><p><b>cause:</b> {_e(one_line(r))}</p>'
        + (f"<p><b>listed as an expected failure:</b> {linkify(r['xfail_reason'])}</p>" if r.get("xfail_reason") else "")
        + f'<pre>{_e(r["message"])}</pre>' + divergence_picture(r)  # per module x event: how far outside the rule
        for r in report["results"] if r["verdict"] in ("failed", "error", "xpassed")
    )
    classes = ", ".join(f"{c}: {n}" for c, n in s.get("failure_classes", {}).items() if n)
    expected = ", ".join(f"{c}: {n}" for c, n in s.get("expected_failure_classes", {}).items() if n)
    empty = "".join(f'<p style="color:{VERDICT_COLOURS[NOTHING_CHECKED]}"><b>{_e(a)}: nothing checked</b> — {_e(why)}</p>'
                    for a, why in nothing_checked(report["results"]).items())
    if run.get("nothing_checked"):
        empty += f'<p style="color:#c62828"><b>exit status 2</b>: {_e(run["nothing_checked"])}</p>'
    suite = report["suite"]
    commit = suite.get("commit") or "unknown (not a git checkout, no VCS install record)"
    dirty = " (with uncommitted changes)" if suite.get("dirty") else ""
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>gradparity report</title>
<style>{CSS}{DIVERGENCE_CSS}</style></head><body>
<h1>gradparity conformance report</h1>
<table class="meta">
<tr><td>suite</td><td>{_e(suite['name'])} {_e(suite['version'])} (schema {_e(report['schema'])}), commit <code>{_e(commit)}</code>{_e(dirty)}</td></tr>
<tr><td>command</td><td><code>{_e(run.get('command') or '?')}</code> ({_e(run.get('launcher') or 'local')})</td></tr>
<tr><td>created</td><td>{_e(report['created'])}</td></tr>
<tr><td>torch</td><td>{_e(env['torch'])} on Python {_e(env['python'])}, {_e(env['platform'])}</td></tr>
<tr><td>run</td><td>profile {_e(run['profile'])}; device {_e(', '.join(run['device']))}; backends {_e(', '.join(run['backends']))};
world sizes {_e(run['world_sizes'])}; seeds {_e(run['seeds'])}</td></tr>
{f'<tr><td><b>ended early</b></td><td style="color:#c62828">{_e(run["stopped"])}</td></tr>' if run.get('stopped') else ''}
</table>
<h2>Adapters</h2><table><tr><th>spec</th><th>name</th><th>version</th><th>area</th><th>owns</th><th>verdict</th>
<th>declared deviations from torch DDP</th></tr>{adapters}</table>
{_compatibility(report)}
{_coverage(report)}
<h2>Matrix ({s['total']} cases)</h2><p class="legend">{legend}</p>
{f'<p>failure classes (failures of this run): {_e(classes)}</p>' if classes else ''}
{f'<p>expected failures&#39; classes (listed known failures, not failures of this run): {_e(expected)}</p>' if expected else ''}
{empty}
{_matrices(report)}
<h2>Failures</h2>{failures or '<p>None.</p>'}
{_expected(report)}
{timelines_section(report)}
</body></html>"""


def write_html(path: str, report: dict) -> str:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:  # the page says charset utf-8 and holds ✓ ◆ µs
        fh.write(render(report))
    os.replace(tmp, path)
    return path
