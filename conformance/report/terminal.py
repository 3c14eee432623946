"""The terminal summary: a table per adapter, then one line per non-pass saying its cause.

The cause line is the record's `[class] cause` (failure.py): for a crash the signal and the dead
rank's last words from its log, for a hang where the rank waited, for an infrastructure error the
rank's own exception — never only that something failed. Skip and expected-failure reasons are
printed here, wherever pytest runs from (its `-ra` is a repository's setting, not ours); an
adapter whose every case was skipped is `nothing checked`, never green (report/verdict.py). A run
that ended early says why. A case
listed as a known intermittent failure (`intermittent:`) gets a `~` line saying which outcome this
run had, whichever it was.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from conformance.report.record import intermittent_outcome, one_line
from conformance.report.verdict import (
    CONFORMANT,
    INCOMPLETE,
    NO_VERDICT,
    NOT_CONFORMANT,
    NOTHING_CHECKED,
    adapter_verdict,
    nothing_checked,
)

STYLE = {"passed": "green", "failed": "bold red", "error": "bold red", "xfailed": "yellow", "xpassed": "magenta", "skipped": "dim"}
COLUMNS = ("passed", "failed", "error", "xfailed", "xpassed", "skipped")
BAD = ("failed", "error", "xpassed")
VERDICT_STYLE = {NOT_CONFORMANT: "bold red", NO_VERDICT: "bold red", INCOMPLETE: "yellow", NOTHING_CHECKED: "yellow",
                 CONFORMANT: "green"}  # nothing checked is never green


def print_summary(terminalreporter, results: list[dict], written: dict | None, unmatched: list[str], *,
                  stopped: str = "", exit_reason: str | None = None) -> None:
    # emoji=False: user strings (adapter specs like `pkg.mod:factory:`, reasons) are never rich codes.
    console = Console(file=terminalreporter._tw._file, force_terminal=None, width=max(100, terminalreporter._tw.fullwidth),
                      emoji=False)
    render(console, results, written, unmatched, stopped=stopped, exit_reason=exit_reason)


def render(console: Console, results: list[dict], written: dict | None, unmatched: list[str], *, stopped: str = "",
           exit_reason: str | None = None) -> None:
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
        state = adapter_verdict(counts, stopped=bool(stopped))
        table.add_row(escape(adapter), *(str(counts[v]) for v in COLUMNS), f"[{VERDICT_STYLE[state]}]{state}[/]")
    if results:
        console.print(table)
    for r in results:
        if r["verdict"] in BAD:
            console.print(f"[red]✗[/] {escape(r['case'])}: {escape(one_line(r))}", highlight=False)
    _reasons(console, results)
    for r in results:  # an `intermittent:` expectation accepts either outcome: say which one this run had
        seen = intermittent_outcome(r)
        if seen:
            console.print(f"[yellow]~[/] {escape(r['case'])}: {escape(seen)}; listed: "
                          f"{escape(_first_line(r['xfail_reason'])[:240])}", highlight=False)
    for adapter, why in nothing_checked(results).items():
        console.print(f"[yellow]–[/] {escape(adapter)}: [yellow]nothing checked[/]: {escape(why)}", highlight=False)
    if exit_reason:
        console.print(f"[bold red]exit status 2[/]: {escape(exit_reason)}", highlight=False)
    if stopped:
        console.print(f"[bold red]the run ended early[/]: {escape(stopped)}", highlight=False)
    for line in unmatched:
        console.print(f"[yellow]warning[/]: {escape(line)}", highlight=False)
    if written:
        for kind, path in written.items():
            console.print(f"{kind} report: {path}", highlight=False)


def _reasons(console: Console, results: list[dict]) -> None:
    """Why each case did not run or is expected to fail, printed here (not left to pytest's `-ra`,
    which only a repository's own configuration turns on): skips grouped by reason, each expected
    failure with its reason, the class of failure it showed labelled as expected."""
    skipped: dict[tuple[str, str], list[str]] = defaultdict(list)
    for r in results:
        if r["verdict"] == "skipped":
            skipped[(r["adapter"], _first_line(r.get("message")) or "no reason given")].append(r["scenario"])
    for (adapter, why), scenarios in sorted(skipped.items()):
        more = f" (+{len(scenarios) - 2} more)" if len(scenarios) > 2 else ""
        console.print(f"[dim]s[/] {escape(adapter)}: {len(scenarios)} skipped: {escape(why)} — "
                      f"{escape(', '.join(scenarios[:2]))}{more}", highlight=False)
    expected = [r for r in results if r["verdict"] == "xfailed"]
    for r in expected:
        seen = f"[expected {r['failure_class']}] " if r.get("failure_class") else ""
        console.print(f"[yellow]x[/] {escape(r['case'])}: {escape(seen)}expected failure: "
                      f"{escape(_first_line(r.get('xfail_reason'))[:240])}", highlight=False)
    classes = Counter(r.get("failure_class") for r in expected if r.get("failure_class"))
    if classes:
        tally = ", ".join(f"{c} {n}" for c, n in classes.most_common())
        console.print(f"expected failures' classes (not failures of this run): {escape(tally)}", highlight=False)


def _first_line(text: str) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""


def print_run_summary(results: list[dict], written: dict | None, unmatched: list[str], console=None, *,
                      stopped: str = "") -> None:
    """The same summary outside pytest (torchrun, scripts): on `console`, or stdout."""
    render(console or Console(width=120, highlight=False, emoji=False), results, written, unmatched, stopped=stopped)
