"""The terminal summary: a table per adapter and the first line of every failure."""

from __future__ import annotations

from collections import Counter, defaultdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

STYLE = {"passed": "green", "failed": "bold red", "xfailed": "yellow", "xpassed": "magenta", "skipped": "dim"}


def print_summary(terminalreporter, results: list[dict], written: dict | None, unmatched: list[str]) -> None:
    console = Console(file=terminalreporter._tw._file, force_terminal=None, width=max(100, terminalreporter._tw.fullwidth))
    by_adapter: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        by_adapter[r["adapter"]][r["verdict"]] += 1
    table = Table(title="gradparity conformance summary", show_lines=False)
    table.add_column("adapter")
    for verdict in ("passed", "failed", "xfailed", "xpassed", "skipped"):
        table.add_column(verdict, justify="right", style=STYLE[verdict])
    table.add_column("verdict")
    for adapter, counts in sorted(by_adapter.items()):
        bad = counts["failed"] + counts["xpassed"]
        table.add_row(
            adapter, *(str(counts[v]) for v in ("passed", "failed", "xfailed", "xpassed", "skipped")),
            "[bold red]NOT CONFORMANT[/]" if bad else "[green]conformant[/]",
        )
    console.print(table)
    for r in results:
        if r["verdict"] in ("failed", "xpassed"):
            first = (r["message"] or "").strip().splitlines()[:1]
            console.print(f"[red]✗[/] {escape(r['case'])}: {escape(first[0] if first else r['verdict'])}", highlight=False)
    for line in unmatched:
        console.print(f"[yellow]warning[/]: {escape(line)}", highlight=False)
    if written:
        for kind, path in written.items():
            console.print(f"{kind} report: {path}", highlight=False)
