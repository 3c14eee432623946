"""compare.html: the page beside compare.json (`gradparity compare`), for people who look.

Per case that moved: the point where the two runs part, and a plot of the largest difference
(in ulps, log scale) at every point of training — a drift that starts at step 0 and stays at
1 ulp reads differently from one that appears at step 3 and grows. Inline SVG, no scripts and
no dependencies: the page opens from a CI artifact as it is.
"""

from __future__ import annotations

import html
import math

COLOUR = {"bitwise": "#2e7d32", "within": "#f9a825", "beyond": "#c62828"}
W, H, PAD = 520, 120, 28


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _ulps(x) -> float:
    return math.inf if x == "inf" else float(x or 0.0)


def plot(points: list[dict]) -> str:
    """Max ulps per point of training (log10(1 + ulps)); a point where the runs part is coloured."""
    if not points:
        return ""
    values = [_ulps(p["max_ulps"]) for p in points]
    finite = [v for v in values if math.isfinite(v)] or [1.0]
    top = math.log10(1 + max(max(finite), 1.0)) * 1.1 or 1.0
    step_x = (W - 2 * PAD) / max(1, len(points) - 1)

    def xy(i, v):
        y = top if not math.isfinite(v) else math.log10(1 + v)
        return PAD + i * step_x, H - PAD - (H - 2 * PAD) * min(y, top) / top

    coords = [xy(i, v) for i, v in enumerate(values)]
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
    dots = "".join(
        f"<circle cx='{x:.1f}' cy='{y:.1f}' r='3' fill='{COLOUR[p['status']]}'><title>{_e(p['label'])}: "
        f"{p['differing']} of {p['tensors']} tensors differ, max {_e(p['max_ulps'])} ulps, rel {_e(p['max_rel'])}"
        "</title></circle>" for (x, y), p in zip(coords, points, strict=True))
    ticks = "".join(f"<text x='{coords[i][0]:.1f}' y='{H - 8}' font-size='9' text-anchor='middle'>{_e(p['step'])}</text>"
                    for i, p in enumerate(points) if i == 0 or p["step"] != points[i - 1]["step"])
    axis = (f"<text x='4' y='{PAD - 8}' font-size='9'>max ulps (log)</text>"
            f"<text x='4' y='{PAD + 4}' font-size='9'>{_e(_label(10 ** top - 1))}</text>"
            f"<text x='4' y='{H - PAD + 4}' font-size='9'>0</text>"
            f"<text x='{W - PAD}' y='{H - 8}' font-size='9' text-anchor='end'>step</text>")
    return (f"<svg width='{W}' height='{H}' viewBox='0 0 {W} {H}' role='img' aria-label='difference per step'>"
            f"<line x1='{PAD}' y1='{H - PAD}' x2='{W - PAD}' y2='{H - PAD}' stroke='#999'/>"
            f"<polyline points='{line}' fill='none' stroke='#555' stroke-width='1'/>{dots}{ticks}{axis}</svg>")


def _label(v: float) -> str:
    return f"{v:.3g}"


def _case(c: dict) -> str:
    first = c["first"]
    rows = "".join(
        f"<tr><td>{_e(t['point'])}</td><td>{_e(t['kind'])} <code>{_e(t['name'])}</code> r{_e(t['rank'])}</td>"
        f"<td style='color:{COLOUR[t['status']]}'>{_e(t['status'])}</td><td>{_e(t.get('why', ''))}</td>"
        f"<td>{_e(t.get('max_ulps'))}</td><td>{_e(t.get('max_rel'))}</td></tr>" for t in c["tensors"][:25])
    more = len(c["tensors"]) - 25 + c.get("more_tensors", 0)
    verdicts = "" if c["verdicts"][0] == c["verdicts"][1] else f" — verdict {_e(c['verdicts'][0])} → {_e(c['verdicts'][1])}"
    weighed = any(t.get("max_ulps") is not None for t in c["tensors"])
    size = f"max {_e(c['max_ulps'])} ulps" if weighed else _e(first.get("why", ""))  # nothing to weigh: say why
    return (f"<details {'open' if c['status'] == 'beyond' else ''}><summary><b style='color:{COLOUR[c['status']]}'>"
            f"{_e(c['status'])}</b> <code>{_e(c['case'])}</code> — the runs part at <b>{_e(first['point'])}</b> "
            f"({_e(first['kind'])} <code>{_e(first['name'])}</code>), {size}{verdicts}</summary>"
            f"{plot(c['points'])}<p><small>oracle's rule: {_e(', '.join(c['rules']))}</small></p>"
            "<table><tr><th>point</th><th>tensor</th><th>status</th><th>what</th><th>max ulps</th><th>max rel</th></tr>"
            f"{rows}</table>{f'<p><small>… and {more} more</small></p>' if more > 0 else ''}</details>")


def render(doc: dict) -> str:
    sm, sides = doc["summary"], ""
    for side in ("base", "new"):
        s = doc[side]
        sides += (f"<tr><th>{side.upper()}</th><td><code>{_e(s['directory'])}</code></td><td>torch {_e(s['torch'])}</td>"
                  f"<td>{_e(s['suite_version'])} @{_e((s['commit'] or 'unknown')[:10])}</td>"
                  f"<td>{_e(', '.join(f'{k} {v}' for k, v in s['adapter_versions'].items()))}</td>"
                  f"<td>ran on {_e(', '.join(s.get('ran_on') or []) or 'unknown')}</td>"
                  f"<td>{'' if s['complete'] else 'INCOMPLETE'}</td></tr>")
    first = doc["first"]
    head = ("every common tensor is bitwise equal" if first is None else
            f"first divergence: <code>{_e(first['case'])}</code> at <b>{_e(first['point'])}</b>, {_e(first['kind'])} "
            f"<code>{_e(first['name'])}</code> (rank {_e(first['rank'])}): {_e(first.get('why', ''))}")
    moved = "".join(_case(c) for c in sorted(doc["cases"], key=lambda c: c["status"] != "beyond") if c["first"])
    same = ", ".join(f"<code>{_e(c['case'])}</code>" for c in doc["cases"] if not c["first"])
    one_sided = "".join(f"<p>{len(doc[k])} case(s) recorded in {w} only: {_e(', '.join(doc[k]))}</p>"
                        for k, w in (("only_base", "BASE"), ("only_new", "NEW")) if doc[k])
    return ("<!doctype html><html><head><meta charset='utf-8'><title>gradparity compare</title><style>"
            "body{font-family:sans-serif;margin:1.5em}td,th{padding:2px 8px;text-align:left}"
            "details{margin:.6em 0;border-left:3px solid #ddd;padding-left:.6em}</style></head><body>"
            f"<h1>gradparity compare</h1><table>{sides}</table><p>{head}</p>"
            f"<p>{sm['compared']} cases compared: <b style='color:{COLOUR['bitwise']}'>{sm['bitwise']} bitwise</b>, "
            f"<b style='color:{COLOUR['within']}'>{sm['within']} within the oracle's rule</b>, "
            f"<b style='color:{COLOUR['beyond']}'>{sm['beyond']} beyond it</b> "
            f"(tolerance: {_e(doc.get('tolerance', 'bitwise'))}, exit {_e(doc.get('exit_status'))})</p>"
            f"<h2>Cases that moved</h2>{moved or '<p>none</p>'}<h2>Bitwise equal</h2><p>{same or 'none'}</p>"
            f"{one_sided}</body></html>")
