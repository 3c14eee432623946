"""The terminal summary: a table per adapter, then one line per non-pass saying its cause.

The cause line is the record's `[class] cause` (failure.py): for a crash the signal and the dead
rank's last words from its log, for a hang where the rank waited, for an infrastructure error the
rank's own exception — never only that something failed. A run that ended early says why. A case
listed as a known intermittent failure (`intermittent:`) gets a `~` line saying which outcome this
run had, whichever it was.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from conformance.report.record import intermittent_outcome, one_line

STYLE = {"passed": "green", "failed": "bold red", "error": "bold red", "xfailed": "yellow", "xpassed": "magenta", "skipped": "dim"}
COLUMNS = ("passed", "failed", "error", "xfailed", "xpassed", "skipped")
BAD = ("failed", "error", "xpassed")


def print_summary(terminalreporter, results: list[dict], written: dict | None, unmatched: list[str], *,
                  stopped: str = "") -> None:
    # emoji=False: user strings (adapter specs like `pkg.mod:factory:`, reasons) are never rich codes.
    console = Console(file=terminalreporter._tw._file, force_terminal=None, width=max(100, terminalreporter._tw.fullwidth),
                      emoji=False)
    render(console, results, written, unmatched, stopped=stopped)


def render(console: Console, results: list[dict], written: dict | None, unmatched: list[str], *, stopped: str = "") -> None:
    """The summary on any rich console (the pytest plugin's, or a front end's own)."""
    by_adapter: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        by_adapter[r["adapter"]][r["verdict"]] += 1
    table = Table(title="gradparity conformance summary", show_lines=False)
    table.add_column("adapter", overflow="fold")  # a long pkg.module:factory spec wraps, never "…"-cut
    for verdict in COLUMNS:
        table.add_column(verdict, justify="right", style=STYLE[verdict])
    table.add_column("verdict")
    for adapter, counts in sorted(by_adapter.items()):
        if counts["failed"] + counts["xpassed"]:
            state = "[bold red]NOT CONFORMANT[/]"
        elif counts["error"]:
            state = "[bold red]NO VERDICT[/]"
        elif stopped:  # cases that never ran cannot be called conformant
            state = "[yellow]incomplete[/]"
        else:
            state = "[green]conformant[/]"
        table.add_row(escape(adapter), *(str(counts[v]) for v in COLUMNS), state)
    if results:
        console.print(table)
    for r in results:
        if r["verdict"] in BAD:
            console.print(f"[red]✗[/] {escape(r['case'])}: {escape(one_line(r))}", highlight=False)
    for r in results:  # an `intermittent:` expectation accepts either outcome: say which one this run had
        seen = intermittent_outcome(r)
        if seen:
            console.print(f"[yellow]~[/] {escape(r['case'])}: {escape(seen)}; listed: "
                          f"{escape(_first_line(r['xfail_reason'])[:240])}", highlight=False)
    if stopped:
        console.print(f"[bold red]the run ended early[/]: {escape(stopped)}", highlight=False)
    for line in unmatched:
        console.print(f"[yellow]warning[/]: {escape(line)}", highlight=False)
    if written:
        for kind, path in written.items():
            console.print(f"{kind} report: {path}", highlight=False)


def _first_line(text: str) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""


def print_run_summary(results: list[dict], written: dict | None, unmatched: list[str], console=None, *,
                      stopped: str = "") -> None:
    """The same summary outside pytest (torchrun, scripts): on `console`, or stdout."""
    render(console or Console(width=120, highlight=False, emoji=False), results, written, unmatched, stopped=stopped)
