"""`gradparity zoo --area <area>`: prove the suite's power on an area's known-bad implementations.

Runs every scenario of a profile of one area against the controls (DDP: torch's DDP, the
zoo's correct base `BucketedDDP`, refimpl's DDP; other areas: the built-in adapters and the
area's correct base, `conformance.mutants.<area>:correct`) and against every mutant
of the area's zoo (`conformance.mutants.area_zoo`), then builds the detection table
(mutant -> the scenarios that catch it) and the clause x mutant table.

Cases are planned and run exactly as `gradparity run` plans and runs them
(`conformance.plan.plan_cases`, `conformance.pipeline.run_case` on warm rank pools); the zoo
drives them itself (not through pytest) because it reads more of each `CaseResult`: the failure
class (its "kind": wrong values, raised, hang, crash) and `fired`, the ranks' summed
`mutation_fired` counts (DDP/sharded: `backward_stats()`; bucketer: the record;
data_parallel, single-process: the adapter).

When does a scenario *catch* a mutant? All of:
  1. the case failed: wrong values (`ConformanceError`), or a rank raised, died or hung;
  2. the base `BucketedDDP` passed the same scenario (a scenario the correct base fails
     proves nothing about the mutation);
  3. the mutation took effect in that very case: the ranks report `mutation_fired > 0` (the mutant calls `_fired()` only where its bug changed what the
     correct code would have done), or no rank returned a record at all (hang or crash)
     and the mutant declares `may_abort` (its documented failure mode; no record, no count).
A failure without (3) is listed as "failed, not fired" and does not count; a case where the
mutation fired but the suite saw nothing is listed as "fired, passed" (a blind spot).
Exit status: 0 when every mutant is caught and no control fails; 1 otherwise.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import queue
import threading
import time
from dataclasses import replace

from conformance import catalogue
from conformance import mutants as zoo_mutants
from conformance.adapters import registry
from conformance.case import Case
from conformance.judge.failure import Classified, FailureClass
from conformance.pipeline import CaseResult, PoolExecutor, run_case
from conformance.plan import Selection, plan_cases
from conformance.report import start_run
from conformance.report.record import one_line
from conformance.validation import UsageError

SCHEMA = "gradparity.zoo/2"
BASE = registry.ddp_class_spec(zoo_mutants.BASE)
CONTROLS = ("torch-ddp", BASE, "refimpl-ddp")
# The zoo's short words for the failure classes (conformance.judge.failure) in its tables.
ZOO_KIND = {FailureClass.WRONG_VALUE: "wrong", FailureClass.RAISED: "raised", FailureClass.CRASHED: "crash",
            FailureClass.HUNG: "hang", FailureClass.INFRASTRUCTURE: "infrastructure"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--area", default="ddp", choices=zoo_mutants.ZOO_AREAS, help="whose zoo (default ddp)")
    p.add_argument("--profile", default="quick", choices=catalogue.PROFILES)
    p.add_argument("--report-dir", default="gradparity-reports/zoo", help="where zoo.json and zoo.html go")
    p.add_argument("-n", dest="workers", type=int, default=1, help="cases run concurrently (each worker has its own rank pools)")
    p.add_argument("--timeout-scale", type=float, default=0.25,
                   help="multiply scenario timeouts (default 0.25: a hanging mutant costs 15 s, not 60)")
    p.add_argument("--mutant", action="append", default=[], help="only these mutants of the area (repeatable)")
    p.add_argument("--control", action="append", default=[], help="controls (repeatable; default: the area's built-ins and its zoo base)")
    p.add_argument("--record", default=None, metavar="DIR",
                   help="record every judged tensor into DIR, for `gradparity compare` (conformance/recording.py)")
    p.add_argument("--set", dest="which", default="all", choices=zoo_mutants.ZOO_SETS,
                   help="which mutants: the area's own zoo, the independent one (written from the contracts alone), or all")


# -- running ----------------------------------------------------------------------------------
def _zoo_record(result) -> dict:
    """A `CaseResult` in the shape of the suite's JSON report, plus the zoo's word for its kind."""
    record = result.record()
    kind = ZOO_KIND[result.failure.failure_class] if result.failure is not None else ""
    if kind == "wrong" and result.rank_raised:  # the rank's own record says it raised
        kind, record["failure_class"] = "raised", FailureClass.RAISED.value
    return record | {"kind": kind}


def run_cases(specs: list[str], selection: Selection, *, workers: int, timeout_scale: float,
              progress=None, recorder=None) -> list[dict]:
    """Every planned (adapter, scenario) case of `selection`, through the same plan and pipeline as
    `gradparity run`; a control that cannot load is an `error` on each of its cases."""
    results: list[dict] = []
    todo: queue.Queue = queue.Queue()
    loadable = []
    for spec in specs:
        try:
            registry.load(spec)
            loadable.append(spec)
        except Exception as exc:  # noqa: BLE001 - an unavailable control is a finding, not a crash
            why = Classified(FailureClass.INFRASTRUCTURE, f"cannot load {spec}: {exc}")
            for s in catalogue.select(area=selection.areas[0], profile=selection.profile):
                results.append(_zoo_record(CaseResult(Case(s, spec), "error", why.cause, why)) | {"kind": "unavailable"})
    for case in plan_cases(replace(selection, adapters=tuple(loadable))):
        if case.skip:
            results.append(_zoo_record(run_case(case, None, recorder)))
        else:
            todo.put(case)
    total, lock = todo.qsize(), threading.Lock()

    def worker():
        executor = PoolExecutor(timeout_scale=timeout_scale)
        try:
            while True:
                try:
                    case = todo.get_nowait()
                except queue.Empty:
                    return
                r = _zoo_record(run_case(case, executor, recorder))
                with lock:
                    results.append(r)
                    if progress:
                        progress(len([x for x in results if x["verdict"] != "skipped"]), total, r)
        finally:
            executor.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# -- judging ----------------------------------------------------------------------------------
def judge(results: list[dict], mutants: dict[str, zoo_mutants.Mutant], controls: list[str], base: str = BASE) -> dict:
    """The detection table, the clause x mutant table and the controls' state (rules: module docstring)."""
    by = {(r["adapter"], r["scenario"]): r for r in results}
    scenarios = sorted({r["scenario"] for r in results})
    clauses_of = {r["scenario"]: r.get("clauses") or [] for r in results}
    def passed_by(spec):
        return {s for s in scenarios if by.get((spec, s), {}).get("verdict") == "passed"}

    bases = {getattr(m, "base", "") or base for m in mutants.values()}
    ok_for = {b: passed_by(b) for b in bases}
    table = []
    for name, mutant in mutants.items():
        spec, aborts = mutant.spec, mutant.may_abort
        base_ok = ok_for[getattr(mutant, "base", "") or base]  # judged against its own correct version
        row = {"mutant": name, "class": spec, "bug": mutant.bug, "clause": mutant.clause, "caught_by": [],
               "failed_not_fired": [], "fired_but_passed": [], "skipped": [], "how": {}}
        for s in scenarios:
            r = by.get((spec, s))
            if r is None:
                continue
            if r["verdict"] == "skipped":
                row["skipped"].append(s)
                continue
            effect = (r["fired"] or 0) > 0 or (aborts and r["records"] == 0 and r["kind"] in ("hang", "crash", "raised"))
            if r["verdict"] == "failed" and effect and s in base_ok:
                row["caught_by"].append(s)
                row["how"][s] = r["kind"] if r["kind"] != "wrong" else f"wrong values (fired {r['fired']})"
            elif r["verdict"] == "failed":
                row["failed_not_fired"].append(s)
            elif effect:
                row["fired_but_passed"].append(s)
        row["verdict"] = "caught" if row["caught_by"] else "ESCAPED"
        row["by_clause"] = {}
        for s in row["caught_by"]:
            for c in clauses_of[s]:
                row["by_clause"].setdefault(c, []).append(s)
        table.append(row)
    control_state = {}
    for spec in controls:
        rows = [r for r in results if r["adapter"] == spec]
        bad = [r for r in rows if r["verdict"] in ("failed", "error", "xpassed")]
        control_state[spec] = {
            "passed": sum(r["verdict"] == "passed" for r in rows), "xfailed": sum(r["verdict"] == "xfailed" for r in rows),
            "skipped": sum(r["verdict"] == "skipped" for r in rows), "failed": len(bad),
            "failures": [{"scenario": r["scenario"], "verdict": r["verdict"], "message": one_line(r)} for r in bad],
        }
    clauses = sorted({c for cs in clauses_of.values() for c in cs} | {row["clause"] for row in table if row["clause"]},
                     key=_clause_key)
    per_clause = {c: sum(c in cs for cs in clauses_of.values()) for c in clauses}
    return {"table": table, "controls": control_state, "cover": minimal_cover(table), "clauses": clauses,
            "scenarios_per_clause": per_clause}


def _clause_key(clause: str):
    head = clause.rstrip("0123456789")
    tail = clause[len(head):]
    return (head, int(tail) if tail else 0)


def minimal_cover(table: list[dict]) -> list[str]:
    """A small set of scenarios that together catch every caught mutant (greedy set cover)."""
    left = {row["mutant"] for row in table if row["caught_by"]}
    catches: dict[str, set] = {}
    for row in table:
        for s in row["caught_by"]:
            catches.setdefault(s, set()).add(row["mutant"])
    cover = []
    while left:
        best = max(sorted(catches), key=lambda s: len(catches[s] & left))
        cover.append(best)
        left -= catches[best]
    return cover


# -- reporting --------------------------------------------------------------------------------
def _short(scenario_id: str) -> str:
    return scenario_id.split("/", 1)[-1]


def _clause_html(doc: dict) -> str:
    """Clause x mutant: how many scenarios of each clause catch each mutant (its own clause outlined)."""
    e = lambda t: html.escape(str(t), quote=True)  # noqa: E731
    clauses = doc.get("clauses") or []
    if not clauses:
        return ""
    head = "".join(f"<th title='{doc['scenarios_per_clause'].get(c, 0)} scenarios'>{e(c)}</th>" for c in clauses)
    rows = []
    for row in doc["table"]:
        cells = []
        for c in clauses:
            hits = row.get("by_clause", {}).get(c, [])
            own = "outline:2px solid #000;" if c == row.get("clause") else ""
            colour = "#2e7d32;color:#fff" if hits else ("#c62828;color:#fff" if c == row.get("clause") else "#fafafa")
            tip = e(", ".join(map(_short, hits)))
            cells.append(f"<td style='{own}background:{colour};text-align:center' title='{tip}'>{len(hits) or ''}</td>")
        rows.append(f"<tr><td><b>{e(row['mutant'])}</b> <small>({e(row.get('clause') or '—')})</small></td>{''.join(cells)}</tr>")
    per = "".join(f"<td style='text-align:center'>{doc['scenarios_per_clause'].get(c, 0)}</td>" for c in clauses)
    return (f"<h2>Clause × mutant ({e(doc.get('area', 'ddp'))})</h2><p><small>A cell counts the scenarios checking that "
            "clause which catch the mutant; the outlined cell is the clause the mutant breaks (red: no scenario of "
            "its own clause catches it). Clauses: <code>docs/contracts/" + e(doc.get("area", "ddp")) + ".md</code>."
            f"</small></p><table><tr><th>mutant (clause)</th>{head}</tr>" + "".join(rows)
            + f"<tr><td><i>scenarios per clause</i></td>{per}</tr></table>")


def _detection_html(doc: dict) -> str:
    e = lambda t: html.escape(str(t), quote=True)  # noqa: E731
    rows = []
    for row in doc["table"]:
        colour = "#2e7d32" if row["caught_by"] else "#c62828"
        caught = "<br>".join(f"<code>{e(_short(s))}</code> <small>({e(row['how'][s])})</small>" for s in row["caught_by"])
        extra = "".join(f"<br><small>{label}: {e(', '.join(map(_short, row[key])))}</small>"
                        for key, label in (("failed_not_fired", "failed, not fired (not counted)"),
                                           ("fired_but_passed", "fired, passed (blind spot)")) if row[key])
        rows.append(f"<tr><td><b>{e(row['mutant'])}</b><br><small><code>{e(row['class'])}</code></small></td>"
                    f"<td>{e(row['bug'])}</td><td style='color:#fff;background:{colour};text-align:center'>{e(row['verdict'])}</td>"
                    f"<td>{caught or '—'}{extra}</td></tr>")
    controls = "".join(
        f"<tr><td><code>{e(spec)}</code></td><td>{c['passed']}</td><td>{c['xfailed']}</td><td>{c['skipped']}</td>"
        f"<td style='color:{'#c62828' if c['failed'] else '#2e7d32'}'>{c['failed']}</td>"
        f"<td>{'<br>'.join(e(_short(f['scenario']) + ': ' + f['message'][:160]) for f in c['failures'])}</td></tr>"
        for spec, c in doc["controls"].items())
    return (f"<h2>Detection table (area {e(doc.get('area', 'ddp'))}, profile {e(doc['profile'])})</h2>"
            f"<p>{e(doc['summary'])}</p>"
            "<table><tr><th>mutant</th><th>bug</th><th>verdict</th><th>caught by</th></tr>" + "".join(rows) + "</table>"
            f"<p>Minimal covering set: {', '.join(f'<code>{e(_short(s))}</code>' for s in doc['cover'])}</p>"
            "<h2>Controls</h2><table><tr><th>control</th><th>passed</th><th>xfailed</th><th>skipped</th><th>failed</th><th>failures</th></tr>"
            + controls + "</table><p><small>Counting rule: a scenario catches a mutant when the case failed, the base "
            "passed it, and the mutation fired in that case (or no rank answered and the mutant's failure mode is a hang/crash).</small></p>"
            + _clause_html(doc))


ZOO_FILES = ("zoo.json", "zoo.html")


def _write_text(path: str, text: str) -> str:
    """UTF-8 whatever the locale (the page holds ✓), through a rename: a reader never sees half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return path


def write_reports(report_dir: str, doc: dict, results: list[dict], specs: list[str]) -> dict[str, str]:
    from conformance.report.html import render
    from conformance.report.json_report import build_report

    os.makedirs(report_dir, exist_ok=True)
    report = build_report(results, adapters=specs, profile=doc["profile"])
    doc = doc | {"suite_report": {k: report[k] for k in ("schema", "suite", "environment", "run", "adapters", "summary")},
                 "results": report["results"]}
    page = render(report).replace("<title>gradparity report</title>", "<title>gradparity zoo</title>")
    page = page.replace("<h1>gradparity conformance report</h1>", "<h1>gradparity mutant zoo</h1>" + _detection_html(doc), 1)
    return {"json": _write_text(os.path.join(report_dir, ZOO_FILES[0]), json.dumps(doc, indent=2, default=str)),
            "html": _write_text(os.path.join(report_dir, ZOO_FILES[1]), page)}


def print_table(doc: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(emoji=False)  # user strings (specs, messages) are never rich emoji codes
    table = Table(title=f"mutant zoo: detection table (area {doc.get('area', 'ddp')}, profile {doc['profile']})",
                  show_lines=True)
    for col, ratio in (("mutant", 2), ("bug", 3), ("verdict", 1), ("caught by", 6)):
        table.add_column(col, overflow="fold", ratio=ratio)
    for row in doc["table"]:
        caught = ", ".join(_short(s) + ("" if row["how"][s].startswith("wrong") else f" ({row['how'][s]})")
                           for s in row["caught_by"])
        for key, label in (("failed_not_fired", "failed, not fired (not counted)"), ("fired_but_passed", "fired, passed")):
            if row[key]:
                caught += f"\n[dim]{label}: {', '.join(map(_short, row[key]))}[/]"
        verdict = "[green]caught[/]" if row["caught_by"] else "[bold red]ESCAPED[/]"
        table.add_row(row["mutant"], row["bug"], verdict, caught or "—")
    console.print(table)
    controls = Table(title="controls")
    for col in ("control", "passed", "xfailed", "skipped", "failed"):
        controls.add_column(col)
    for spec, c in doc["controls"].items():
        controls.add_row(spec, str(c["passed"]), str(c["xfailed"]), str(c["skipped"]),
                         f"[bold red]{c['failed']}[/]" if c["failed"] else "[green]0[/]")
    console.print(controls)
    for spec, c in doc["controls"].items():
        for f in c["failures"]:
            console.print(f"[red]✗[/] control {spec}: {_short(f['scenario'])}: {f['message'][:200]}", highlight=False)
    console.print(f"minimal covering set: {', '.join(map(_short, doc['cover']))}", highlight=False)
    console.print(doc["summary"], highlight=False)


def zoo(profile: str = "quick", *, area: str = "ddp", report_dir: str = "gradparity-reports/zoo", workers: int = 1,
        timeout_scale: float = 0.25, mutants: list[str] | None = None, controls: list[str] | None = None,
        console=None, which: str = "all", record: str | None = None) -> tuple[int, dict]:
    """Run the zoo of `area`; returns (exit status, the zoo document written to zoo.json)."""
    from rich.console import Console

    console = console or Console(emoji=False)  # user strings (specs, messages) are never rich emoji codes
    area_zoo = zoo_mutants.area_zoo(area, which)
    chosen = {n: area_zoo.mutants[n] for n in (mutants or area_zoo.mutants)}
    controls = list(controls or area_zoo.controls)
    for base in [area_zoo.base, *(m.base for m in chosen.values() if m.base)]:
        if base not in controls:
            controls.append(base)  # a base is what "caught" is judged against
    specs = controls + [m.spec for m in chosen.values()]
    selection = Selection(adapters=tuple(specs), profile=profile, areas=(area,))
    scenarios = catalogue.select(area=area, profile=profile)
    start_run(report_dir, ZOO_FILES)  # a zoo run that dies early must not leave the previous verdicts looking current
    t0 = time.perf_counter()

    def progress(done, total, r):
        mark = {"passed": "✓", "failed": "✗", "error": "E", "xfailed": "x", "xpassed": "!"}.get(r["verdict"], "?")
        fired = f" fired={r['fired']}" if r["fired"] else ""
        who = r["adapter"].removeprefix("ddp-class=").removeprefix("conformance.mutants.")
        console.print(f"[{done:>3}/{total}] {mark} {who} | {_short(r['scenario'])} {r['kind']}{fired} "
                      f"({r['duration_s']:.1f}s)", highlight=False)

    recorder = None
    if record:
        from conformance.recording import Recorder
        from conformance.report import run_info

        recorder = Recorder(record)
        recorder.start(info := run_info.collect(profile=profile, adapters=specs))
    results = run_cases(specs, selection, workers=workers, timeout_scale=timeout_scale, progress=progress,
                        recorder=recorder)
    if recorder is not None:
        recorder.finish(info)
    doc = judge(results, chosen, controls, base=area_zoo.base)
    escaped = [row["mutant"] for row in doc["table"] if not row["caught_by"]]
    bad_controls = [spec for spec, c in doc["controls"].items() if c["failed"]]
    seconds = time.perf_counter() - t0
    doc.update(
        schema=SCHEMA, area=area, profile=profile, timeout_scale=timeout_scale, scenarios=[s.id for s in scenarios],
        seconds=round(seconds, 1), escaped=escaped, failed_controls=bad_controls,
        summary=(f"{area}: {len(chosen) - len(escaped)}/{len(chosen)} mutants caught"
                 + (f" (ESCAPED: {', '.join(escaped)})" if escaped else "")
                 + f"; controls failing: {', '.join(bad_controls) if bad_controls else 'none'}"
                 + f"; {len(doc['clauses'])} clauses; {len(scenarios)} scenarios × {len(specs)} implementations"
                 + f" in {seconds:.0f}s"),
    )
    paths = write_reports(report_dir, doc, results, specs)
    print_table(doc, console)
    console.print(f"zoo json: {paths['json']}\nzoo html: {paths['html']}", highlight=False)
    return (1 if escaped or bad_controls else 0), doc


def cmd_zoo(args) -> int:
    try:
        area_zoo = zoo_mutants.area_zoo(args.area, args.which)
    except ValueError as exc:
        raise UsageError(f"{exc}; use --set all or own") from None
    unknown = [m for m in args.mutant if m not in area_zoo.mutants]
    if unknown:
        raise UsageError(f"unknown {args.area} mutant {unknown[0]!r}; known: {', '.join(area_zoo.mutants)}")
    for spec in args.control:
        registry.load(spec)  # a bad control name is a usage error (AdapterError), before any process
    from conformance.validation import check_report_dir

    check_report_dir(args.report_dir)
    if args.record:
        from conformance.recording import check_directory

        check_directory(args.record)
    code, _ = zoo(args.profile, area=args.area, report_dir=args.report_dir, workers=args.workers,
                  timeout_scale=args.timeout_scale, mutants=args.mutant or None, controls=args.control or None,
                  which=args.which, record=args.record)
    return code
