"""The compatibility matrix: engines × scenario groups, counted by verdict.

A scenario's group comes from the name part of its id (`ddp/<name>/<model>/w2/fp32`), so the
matrix stays readable whatever the profile: one row per adapter, one column per group, each cell
"passed/failed/xfailed" counts (skips listed apart, with their reasons in the full report).
"""

from __future__ import annotations

from collections import Counter, defaultdict

# (group, name prefixes), first match wins.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("basics", ("plain", "adam", "buffers")),
    ("bucketing", ("bucket-", "static-graph")),
    ("unused params", ("unused", "rank-uses-no-param")),
    ("no_sync", ("no-sync",)),
    ("structure", ("tied", "frozen", "mixed-dtype", "sparse", "dense-embedding")),
    ("uneven data", ("uneven",)),
    ("precision & hooks", ("fp16-params", "bf16-params", "fp64-params", "hook-")),
    ("training loop", ("set-to-none", "zero-grad", "long", "skew", "buffer-order", "powersgd")),
    ("production training", ("join", "autocast", "grad-scaler", "ckpt", "compile", "clip-grad-norm",
                             "requires-grad-toggle", "checkpoint-round-trip", "determinism")),
    ("sweeps", ("sweep-",)),
)
VERDICTS = ("passed", "failed", "xfailed", "xpassed", "skipped")


def group_of(scenario_id: str) -> str:
    parts = scenario_id.split("/")
    name = parts[1] if len(parts) > 1 else scenario_id
    for group, prefixes in GROUPS:
        if name.startswith(prefixes):
            return group
    return "other"


def tally(results: list[dict]) -> tuple[list[str], dict[str, dict[str, Counter]]]:
    """(groups present, in GROUPS order) and {adapter: {group: Counter(verdict)}}."""
    cells: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    seen = set()
    for r in results:
        group = group_of(r["scenario"])
        seen.add(group)
        cells[r["adapter"]][group][r["verdict"]] += 1
    order = [g for g, _ in GROUPS if g in seen] + (["other"] if "other" in seen else [])
    return order, cells


def cell_text(counts: Counter) -> str:
    """`3✓ 1✗ 2x` style: passed, failed, xfailed (and xpassed '!' / skipped '–' when present)."""
    if not counts:
        return "n/a"
    parts = [f"{counts['passed']}✓"]
    for verdict, mark in (("failed", "✗"), ("xfailed", "x"), ("xpassed", "!"), ("skipped", "–")):
        if counts[verdict]:
            parts.append(f"{counts[verdict]}{mark}")
    return " ".join(parts)
