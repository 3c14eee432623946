"""The HTML report: one self-contained page people look at.

An adapter × scenario matrix (colour = verdict, hover = the first line of the message),
provenance, every failure in full, and a bucket timeline where an implementation reports
backward stats (when each bucket's collective was launched and finished during backward).
"""

from __future__ import annotations

import html
import os
from collections import defaultdict

from conformance.report.record import one_line

COLOURS = {
    "passed": "#2e7d32", "failed": "#c62828", "xfailed": "#f9a825", "xpassed": "#8e24aa",
    "skipped": "#9e9e9e", "error": "#c62828",
}
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
        parts.append(f"<h3>{_e(area)} <small>({len(results)} cases: {_e(tally)})</small></h3>" + _matrix(results, adapters))
    return "".join(parts)


def _matrix(results: list[dict], adapters: list[str]) -> str:
    cells: dict[str, dict[str, dict]] = defaultdict(dict)
    meta: dict[str, dict] = {}
    for r in results:
        cells[r["scenario"]][r["adapter"]] = r
        meta[r["scenario"]] = r
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
            anchor = f' href="#f-{_e(r["case"])}"' if r["verdict"] in ("failed", "error", "xpassed") else ""
            declared = r.get("declared") or []
            if declared:  # the verdict holds under these declared deviations from torch DDP
                first += " | declared: " + "; ".join(declared)
            mark = " ◆" if declared else ""
            tds.append(
                f'<td class="v" style="background:{COLOURS.get(r["verdict"], "#555")}" title="{_e(first)}">'
                f'<a style="color:#fff"{anchor}>{SYMBOL.get(r["verdict"], "?")} {_e(r["verdict"])}{mark}</a></td>'
            )
        upstream = f' <small>({_e(m["upstream"])})</small>' if m.get("upstream") else ""
        rows.append(
            f"<tr><td><code>{_e(scenario)}</code>{upstream}<br><small>{_e(m['options'])}; tolerance {_e(m['tolerance'])}</small></td>"
            + "".join(tds) + "</tr>"
        )
    head = "".join(f"<th>{_e(a)}</th>" for a in adapters)
    return f"<table><tr><th>scenario</th>{head}</tr>{''.join(rows)}</table>"


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
        bad = totals["failed"] + totals["xpassed"]
        colour = COLOURS["failed"] if bad else (COLOURS["xfailed"] if totals["xfailed"] else COLOURS["passed"])
        declared = "; ".join(info.get(adapter, {}).get("semantics") or []) or "torch DDP semantics"
        tds = "".join(f"<td>{_e(cell_text(cells[adapter][g]))}</td>" for g in groups)
        summary = ", ".join(f"{totals[v]} {v}" for v in VERDICTS if totals[v])
        rows.append(
            f'<tr><td><b>{_e(adapter)}</b> {_e(info.get(adapter, {}).get("version", ""))}<br><small>{_e(declared)}</small></td>'
            f'{tds}<td style="color:{colour}"><b>{_e(summary)}</b></td></tr>'
        )
    head = "".join(f"<th>{_e(g)}</th>" for g in groups)
    return (
        "<h2>Compatibility matrix</h2><p><small>per scenario group: ✓ passed, ✗ failed, x expected failure "
        "(strict, with its upstream reference), ! unexpectedly passed, – skipped; ◆ in a cell below marks a "
        "verdict under declared semantics (hover for them)</small></p>"
        f"<table><tr><th>adapter</th>{head}<th>total</th></tr>{''.join(rows)}</table>"
    )


def _timeline(result: dict) -> str:
    """An SVG of bucket collectives over the backward pass, from an implementation's stats."""
    per_rank = (result.get("details") or {}).get("backward_stats") or {}
    stats = per_rank.get(0) or per_rank.get("0") or {}  # rank 0's view (JSON turns keys into strings)
    buckets = stats.get("buckets") if isinstance(stats, dict) else None
    if not buckets:
        return ""
    end = max([b.get("finish_ns") or b.get("launch_ns") or 0 for b in buckets] + [stats.get("backward_end_ns") or 0]) or 1
    width, row = 640, 16
    bars = []
    for i, b in enumerate(buckets):
        ready = b.get("ready_ns", b.get("launch_ns", 0)) or 0
        launch = b.get("launch_ns", 0) or 0
        finish = b.get("finish_ns", launch) or launch
        x0, x1, x2 = (width * t / end for t in (ready, launch, finish))
        y = i * row + 4
        bars.append(f'<rect x="{x0:.1f}" y="{y}" width="{max(1, x1 - x0):.1f}" height="{row - 6}" fill="#90caf9"/>')
        bars.append(f'<rect x="{x1:.1f}" y="{y}" width="{max(1, x2 - x1):.1f}" height="{row - 6}" fill="#1565c0"/>')
        bars.append(f'<text x="{width + 6}" y="{y + 9}" font-size="10">bucket {b.get("index", i)}</text>')
    if stats.get("backward_end_ns"):
        x = width * stats["backward_end_ns"] / end
        bars.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{len(buckets) * row + 4}" stroke="#c62828"/>')
    svg = f'<svg width="{width + 80}" height="{len(buckets) * row + 8}">{"".join(bars)}</svg>'
    return (
        f"<h3>Bucket timeline: {_e(result['case'])}</h3>"
        f"<p><small>light: gradients filling the bucket; dark: collective in flight; red: end of backward "
        f"({end / 1e6:.2f} ms span)</small></p>{svg}"
    )


def render(report: dict) -> str:
    s = report["summary"]
    env, run = report["environment"], report["run"]
    adapters = "".join(
        f"<tr><td>{_e(a['spec'])}</td><td>{_e(a.get('name'))}</td><td>{_e(a.get('version'))}</td><td>{_e(a.get('area', ''))}</td>"
        f"<td>{_e(', '.join(a.get('owns') or []) or '-')}</td>"
        f"<td>{_e('; '.join(a.get('semantics') or []) or 'torch DDP semantics')}"
        f"{''.join(f'<br><small>{_e(src)}</small>' for src in a.get('semantics_sources') or [])}</td></tr>"
        for a in report["adapters"]
    )
    legend = "".join(f'<span style="background:{c}">{v}: {s.get(v, 0)}</span>' for v, c in COLOURS.items())
    failures = "".join(
        f'<h3 id="f-{_e(r["case"])}">{_e(r["case"])} — {_e(r["verdict"])}'
        + (f' ({_e(r["failure_class"])})' if r.get("failure_class") else "")
        + f'</h3><p><b>cause:</b> {_e(one_line(r))}</p><pre>{_e(r["message"])}</pre>'
        for r in report["results"] if r["verdict"] in ("failed", "error", "xpassed")
    )
    classes = ", ".join(f"{c}: {n}" for c, n in s.get("failure_classes", {}).items() if n)
    timelines = "".join(_timeline(r) for r in report["results"] if r["verdict"] == "passed")[:400_000]
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>gradparity report</title>
<style>{CSS}</style></head><body>
<h1>gradparity conformance report</h1>
<table class="meta">
<tr><td>suite</td><td>{_e(report['suite']['name'])} {_e(report['suite']['version'])} (schema {_e(report['schema'])})</td></tr>
<tr><td>created</td><td>{_e(report['created'])}</td></tr>
<tr><td>torch</td><td>{_e(env['torch'])} on Python {_e(env['python'])}, {_e(env['platform'])}</td></tr>
<tr><td>run</td><td>profile {_e(run['profile'])}; device {_e(', '.join(run['device']))}; backends {_e(', '.join(run['backends']))};
world sizes {_e(run['world_sizes'])}; seeds {_e(run['seeds'])}</td></tr>
</table>
<h2>Adapters</h2><table><tr><th>spec</th><th>name</th><th>version</th><th>area</th><th>owns</th>
<th>declared deviations from torch DDP</th></tr>{adapters}</table>
{_compatibility(report)}
<h2>Matrix ({s['total']} cases)</h2><p class="legend">{legend}</p>
{f'<p>failure classes: {_e(classes)}</p>' if classes else ''}
{_matrices(report)}
<h2>Failures</h2>{failures or '<p>None.</p>'}
{('<h2>Bucket timelines</h2>' + timelines) if timelines else ''}
</body></html>"""


def write_html(path: str, report: dict) -> str:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(render(report))
    os.replace(tmp, path)
    return path
