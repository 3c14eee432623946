"""The terminal summary: a table per adapter and the first line of every failure."""

from __future__ import annotations

from collections import Counter, defaultdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from conformance.report.record import one_line

STYLE = {"passed": "green", "failed": "bold red", "error": "bold red", "xfailed": "yellow", "xpassed": "magenta", "skipped": "dim"}
COLUMNS = ("passed", "failed", "error", "xfailed", "xpassed", "skipped")
BAD = ("failed", "error", "xpassed")


def print_summary(terminalreporter, results: list[dict], written: dict | None, unmatched: list[str]) -> None:
    console = Console(file=terminalreporter._tw._file, force_terminal=None, width=max(100, terminalreporter._tw.fullwidth))
    by_adapter: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        by_adapter[r["adapter"]][r["verdict"]] += 1
    table = Table(title="gradparity conformance summary", show_lines=False)
    table.add_column("adapter")
    for verdict in COLUMNS:
        table.add_column(verdict, justify="right", style=STYLE[verdict])
    table.add_column("verdict")
    for adapter, counts in sorted(by_adapter.items()):
        if counts["failed"] + counts["xpassed"]:
            state = "[bold red]NOT CONFORMANT[/]"
        elif counts["error"]:
            state = "[bold red]NO VERDICT[/]"
        else:
            state = "[green]conformant[/]"
        table.add_row(adapter, *(str(counts[v]) for v in COLUMNS), state)
    console.print(table)
    for r in results:
        if r["verdict"] in BAD:
            console.print(f"[red]✗[/] {escape(r['case'])}: {escape(one_line(r))}", highlight=False)
    for line in unmatched:
        console.print(f"[yellow]warning[/]: {escape(line)}", highlight=False)
    if written:
        for kind, path in written.items():
            console.print(f"{kind} report: {path}", highlight=False)
