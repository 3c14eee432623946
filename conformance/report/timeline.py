"""Bucket timelines: one compact figure per adapter, drawn from the reducer's backward stats.

The data is what an implementation's `backward_stats()` (or refimpl's `get_backward_stats()`)
reports for rank 0's last synced backward, as the DDP runner records it in a case's
`details.backward_stats`: per bucket `ready_ns` (its first gradient arrived), `launch_ns` (its
collective started), `finish_ns` (it completed), `nbytes`; and `backward_end_ns`, all in ns
since the backward began. One figure per adapter — the passing case with the most buckets,
where overlap of communication with backward is most visible — with a time axis; an adapter
with no figure gets a line saying why, so an empty section is never a silent gap.
"""

from __future__ import annotations

import html
import math

WIDTH, ROW, LABEL_W = 560, 14, 96
MAX_ROWS = 24  # buckets per figure: a compact figure beats a complete one
TIMED_AREAS = ("ddp", "sharded")  # the areas whose runner records backward stats


def stats_of(result: dict) -> dict | None:
    """Rank 0's backward stats of a case, if it has buckets to draw (JSON turns rank keys into strings)."""
    per_rank = (result.get("details") or {}).get("backward_stats") or {}
    if not isinstance(per_rank, dict):
        return None
    # {rank: stats} as the DDP runner records it, or rank 0's stats alone (the zoo's records)
    stats = per_rank if "buckets" in per_rank else (per_rank.get(0) or per_rank.get("0"))
    if isinstance(stats, dict) and stats.get("buckets"):
        return stats
    return None


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next((m * power for m in (1, 2, 5, 10) if m * power >= raw), 10 * power)


def _time_label(ns: float, step: float) -> str:
    if step >= 1e6:
        return f"{ns / 1e6:g} ms"
    if step >= 1e3:
        return f"{ns / 1e3:g} µs"
    return f"{ns:g} ns"


def _size(nbytes) -> str:
    if not isinstance(nbytes, (int, float)):
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def svg(stats: dict) -> str:
    """The figure: one row per bucket (light: filling, dark: in flight), a red end-of-backward line,
    and a time axis with round ticks."""
    buckets = stats["buckets"]
    times = [t for b in buckets for t in (b.get("ready_ns"), b.get("launch_ns"), b.get("finish_ns")) if t]
    end = max(times + [stats.get("backward_end_ns") or 0, 1])
    scale = WIDTH / end
    height = len(buckets) * ROW
    parts = []
    for i, b in enumerate(buckets):
        launch = b.get("launch_ns") or 0
        ready = b.get("ready_ns", launch) or launch
        finish = b.get("finish_ns") or launch
        y = i * ROW + 2
        x0, x1, x2 = (LABEL_W + scale * t for t in (ready, launch, finish))
        label = f"bucket {b.get('index', i)}" + (f" · {_size(b.get('nbytes'))}" if b.get("nbytes") is not None else "")
        parts.append(f'<text x="{LABEL_W - 4}" y="{y + ROW - 5}" font-size="10" text-anchor="end">{html.escape(label)}</text>')
        parts.append(f'<rect x="{x0:.1f}" y="{y}" width="{max(1, x1 - x0):.1f}" height="{ROW - 4}" fill="#90caf9"/>')
        parts.append(f'<rect x="{x1:.1f}" y="{y}" width="{max(1, x2 - x1):.1f}" height="{ROW - 4}" fill="#1565c0"/>')
    if stats.get("backward_end_ns"):
        x = LABEL_W + scale * stats["backward_end_ns"]
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{height + 2}" stroke="#c62828"/>')
    step = _nice_step(end)
    axis_y = height + 4
    parts.append(f'<line x1="{LABEL_W}" x2="{LABEL_W + WIDTH}" y1="{axis_y}" y2="{axis_y}" stroke="#555"/>')
    for k in range(int(end // step) + 1):
        tick = round(k * step, 6)
        x = LABEL_W + scale * tick
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{axis_y}" y2="{axis_y + 4}" stroke="#555"/>')
        parts.append(f'<text x="{x:.1f}" y="{axis_y + 14}" font-size="9" text-anchor="middle">{_time_label(tick, step)}</text>')
    return (f'<svg class="timeline" width="{LABEL_W + WIDTH + 24}" height="{axis_y + 18}" role="img" '
            f'aria-label="bucket timeline">{"".join(parts)}</svg>')


def section(report: dict) -> str:
    """The report's "Bucket timelines" section: a figure per adapter, or why there is none."""
    parts = []
    for adapter in report["adapters"]:
        spec = adapter["spec"]
        results = [r for r in report["results"] if r["adapter"] == spec]
        if not results:
            continue
        area = adapter.get("area") or results[0].get("area")
        if area not in TIMED_AREAS:
            parts.append(f"<li><b>{html.escape(spec)}</b>: no timeline — area {html.escape(str(area))} has no "
                         "bucketed DDP backward to time</li>")
            continue
        drawable = [(r, stats_of(r)) for r in results]
        drawable = [(r, s) for r, s in drawable if s]
        passed = [(r, s) for r, s in drawable if r["verdict"] == "passed"]
        if not passed:
            if not any(r["verdict"] == "passed" for r in results):
                why = "none of its cases passed (a failing case's timing is not a timeline of the algorithm)"
            else:
                why = ("it reports no per-bucket backward stats (an engine exposing <code>backward_stats()</code> "
                       "or refimpl's <code>get_backward_stats()</code> gets one)")
            parts.append(f"<li><b>{html.escape(spec)}</b>: no timeline — {why}</li>")
            continue
        # the most buckets that still fit a compact figure; past MAX_ROWS, the fewest
        result, stats = max(passed, key=lambda rs: (len(rs[1]["buckets"]) <= MAX_ROWS,
                                                    len(rs[1]["buckets"]) * (1 if len(rs[1]["buckets"]) <= MAX_ROWS else -1),
                                                    -len(rs[0]["scenario"]), rs[0]["scenario"]))
        shown = len(stats["buckets"])
        if shown > MAX_ROWS:
            stats = dict(stats, buckets=stats["buckets"][:MAX_ROWS])
        others = len(passed) - 1
        parts.append(
            f"<li><b>{html.escape(spec)}</b>: <code>{html.escape(result['scenario'])}</code>, rank 0's last backward, "
            f"{shown} bucket(s)" + (f", the first {MAX_ROWS} drawn" if shown > MAX_ROWS else "")
            + (f" <small>({others} other passing case(s) recorded stats too; the one with the most buckets "
               f"(up to {MAX_ROWS}) is drawn)</small>"
               if others else "")
            + f"<br>{svg(stats)}</li>")
    if not parts:
        return ""
    return ("<h2>Bucket timelines</h2><p><small>one figure per adapter; light: gradients filling the bucket, dark: its "
            "collective in flight, red: end of backward; time since the backward began</small></p>"
            f"<ul class=\"timelines\">{''.join(parts)}</ul>")
