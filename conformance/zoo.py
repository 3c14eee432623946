"""`gradparity zoo`: prove the suite's power on a zoo of known-bad DDP implementations.

Runs every scenario of a profile against the controls (torch's DDP, the zoo's correct base
`BucketedDDP`, refimpl's DDP) and against every mutant of `conformance.fixtures.mutants`,
then builds the detection table: mutant -> the scenarios that catch it.

Cases run on the same warm rank pools, rank-side task and judge (`conformance.runners.ddp`)
as `gradparity run`; the zoo dispatches them itself (not through pytest) because it needs
each case's outcome kind (wrong values, hang, crash) and every rank's backward stats.

When does a scenario *catch* a mutant? All of:
  1. the case failed: wrong values (`ConformanceError`), or a rank raised, died or hung;
  2. the base `BucketedDDP` passed the same scenario (a scenario the correct base fails
     proves nothing about the mutation);
  3. the mutation took effect in that very case: the ranks' `backward_stats()` report
     `mutation_fired > 0` (the mutant calls `_fired()` only where its bug changed what the
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

from conformance import catalogue
from conformance.adapters import registry
from conformance.adapters.protocol import missing_capabilities
from conformance.compare import ConformanceError
from conformance.expectations import builtin_xfails, read_expectations
from conformance.fixtures import mutants as zoo_mutants
from conformance.report.record import case_id, case_record
from conformance.runners import ddp as ddp_driver
from conformance.spec import Scenario

SCHEMA = "gradparity.zoo/1"
BASE = registry.ddp_class_spec(zoo_mutants.BASE)
CONTROLS = ("torch-ddp", BASE, "refimpl-ddp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="quick", choices=catalogue.PROFILES)
    p.add_argument("--report-dir", default="gradparity-reports/zoo", help="where zoo.json and zoo.html go")
    p.add_argument("-n", dest="workers", type=int, default=1, help="cases run concurrently (each worker has its own rank pools)")
    p.add_argument("--timeout-scale", type=float, default=0.25,
                   help="multiply scenario timeouts (default 0.25: a hanging mutant costs 15 s, not 60)")
    p.add_argument("--mutant", action="append", default=[], help=f"only these mutants (repeatable); known: {', '.join(zoo_mutants.MUTANTS)}")
    p.add_argument("--control", action="append", default=[], help="controls (repeatable; default torch-ddp, the zoo base, refimpl-ddp)")


# -- running ----------------------------------------------------------------------------------
def _expected_failures(adapter_name: str) -> dict[str, str]:
    path = builtin_xfails(adapter_name)
    return read_expectations(path) if path else {}


def _run_case(pools, spec: str, scenario: Scenario, timeout_scale: float) -> dict:
    from conformance.harness.context import choose_topology

    t0 = time.perf_counter()
    topology = choose_topology(scenario.world_size, scenario.device)
    outcome = pools.get(topology).run(
        ddp_driver.TASK, (scenario, spec),
        timeout=scenario.timeout_s * timeout_scale, label=f"{scenario.id} with {spec}",
    )
    stats = {r: v.get("backward_stats") for r, v in outcome.values.items() if isinstance(v, dict)}
    fired = [s.get("mutation_fired", 0) for s in stats.values() if isinstance(s, dict)]
    result = {"verdict": "passed", "kind": "", "message": "", "records": len(outcome.values),
              "fired": sum(fired) if fired else None, "comparisons": None, "accepted_error": None}
    try:
        checked = ddp_driver.judge(scenario, spec, outcome, where=topology.key())
        result.update(comparisons=checked.comparisons, accepted_error=checked.accepted_error)
    except ConformanceError as exc:
        if outcome.ok:
            kind = "wrong"
        else:
            kind = "hang" if "timeout" in {f.kind for f in outcome.failures.values()} else "crash"
        result.update(verdict="failed", kind=kind, message=str(exc)[:6000])
    result["duration_s"] = round(time.perf_counter() - t0, 4)
    result["details"] = {"backward_stats": stats.get(0), "fired_per_rank": {str(r): s.get("mutation_fired") for r, s in stats.items() if isinstance(s, dict)}}
    return result


def _record(spec: str, scenario: Scenario, **fields) -> dict:
    """A result in the shape of the suite's JSON report (so its HTML matrix renders it)."""
    base = case_record(spec, scenario, verdict="passed", message="", duration_s=0.0)
    return base | {"kind": "", "records": 0, "fired": None} | fields


def run_cases(specs: list[str], scenarios: list[Scenario], *, workers: int, timeout_scale: float,
              progress=None) -> list[dict]:
    """Every (adapter, scenario) case; skips and controls' expected failures resolved here."""
    from conformance.harness.pool import PoolManager

    results: list[dict] = []
    todo: queue.Queue = queue.Queue()
    for spec in specs:
        try:
            adapter = registry.load(spec)
        except Exception as exc:  # noqa: BLE001 - an unavailable control is a finding, not a crash
            for s in scenarios:
                results.append(_record(spec, s, verdict="failed", kind="unavailable", message=f"cannot load {spec}: {exc}"))
            continue
        xfails = _expected_failures(adapter.name)
        for s in scenarios:
            missing = missing_capabilities(adapter, s.requires)
            if missing or adapter.area != s.area:
                why = f"{adapter.name} lacks capability: {', '.join(c.value for c in missing)}" if missing else "other area"
                results.append(_record(spec, s, verdict="skipped", message=why))
            else:
                todo.put((spec, s, xfails.get(case_id(spec, s)) or xfails.get(s.id)))
    total, lock = todo.qsize(), threading.Lock()

    def worker():
        pools = PoolManager()
        try:
            while True:
                try:
                    spec, s, xfail = todo.get_nowait()
                except queue.Empty:
                    return
                r = _record(spec, s, **_run_case(pools, spec, s, timeout_scale))
                if xfail is not None:
                    r["verdict"] = "xfailed" if r["verdict"] == "failed" else "xpassed"
                    r["message"] = (r["message"] or f"expected to fail: {xfail}")
                with lock:
                    results.append(r)
                    if progress:
                        progress(len([x for x in results if x["verdict"] != "skipped"]), total, r)
        finally:
            pools.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# -- judging ----------------------------------------------------------------------------------
def judge(results: list[dict], mutants: dict[str, tuple[str, str]], controls: list[str]) -> dict:
    """The detection table and the controls' state (see the module docstring for the rules)."""
    by = {(r["adapter"], r["scenario"]): r for r in results}
    scenarios = sorted({r["scenario"] for r in results})
    base_ok = {s for s in scenarios if by.get((BASE, s), {}).get("verdict") == "passed"}
    table = []
    for name, (path, bug) in mutants.items():
        spec = registry.ddp_class_spec(path)
        aborts = zoo_mutants.may_abort(name)
        row = {"mutant": name, "class": path, "bug": bug, "caught_by": [], "failed_not_fired": [],
               "fired_but_passed": [], "skipped": [], "how": {}}
        for s in scenarios:
            r = by.get((spec, s))
            if r is None:
                continue
            if r["verdict"] == "skipped":
                row["skipped"].append(s)
                continue
            effect = (r["fired"] or 0) > 0 or (aborts and r["records"] == 0 and r["kind"] in ("hang", "crash"))
            if r["verdict"] == "failed" and effect and s in base_ok:
                row["caught_by"].append(s)
                row["how"][s] = r["kind"] if r["kind"] != "wrong" else f"wrong values (fired {r['fired']})"
            elif r["verdict"] == "failed":
                row["failed_not_fired"].append(s)
            elif effect:
                row["fired_but_passed"].append(s)
        row["verdict"] = "caught" if row["caught_by"] else "ESCAPED"
        table.append(row)
    control_state = {}
    for spec in controls:
        rows = [r for r in results if r["adapter"] == spec]
        bad = [r for r in rows if r["verdict"] in ("failed", "xpassed")]
        control_state[spec] = {
            "passed": sum(r["verdict"] == "passed" for r in rows), "xfailed": sum(r["verdict"] == "xfailed" for r in rows),
            "skipped": sum(r["verdict"] == "skipped" for r in rows), "failed": len(bad),
            "failures": [{"scenario": r["scenario"], "verdict": r["verdict"], "message": r["message"].splitlines()[0] if r["message"] else ""} for r in bad],
        }
    return {"table": table, "controls": control_state, "cover": minimal_cover(table)}


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
    return scenario_id.removeprefix("ddp/")


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
    return (f"<h2>Detection table (profile {e(doc['profile'])})</h2>"
            f"<p>{e(doc['summary'])}</p>"
            "<table><tr><th>mutant</th><th>bug</th><th>verdict</th><th>caught by</th></tr>" + "".join(rows) + "</table>"
            f"<p>Minimal covering set: {', '.join(f'<code>{e(_short(s))}</code>' for s in doc['cover'])}</p>"
            "<h2>Controls</h2><table><tr><th>control</th><th>passed</th><th>xfailed</th><th>skipped</th><th>failed</th><th>failures</th></tr>"
            + controls + "</table><p><small>Counting rule: a scenario catches a mutant when the case failed, the base "
            "passed it, and the mutation fired in that case (or no rank answered and the mutant's failure mode is a hang/crash).</small></p>")


def write_reports(report_dir: str, doc: dict, results: list[dict], specs: list[str]) -> dict[str, str]:
    from conformance.report.html import render
    from conformance.report.json_report import build_report

    os.makedirs(report_dir, exist_ok=True)
    report = build_report(results, adapters=specs)
    report["run"]["profile"] = doc["profile"]
    doc = doc | {"suite_report": {k: report[k] for k in ("schema", "suite", "environment", "run", "adapters", "summary")},
                 "results": report["results"]}
    paths = {"json": os.path.join(report_dir, "zoo.json"), "html": os.path.join(report_dir, "zoo.html")}
    with open(paths["json"], "w") as fh:
        json.dump(doc, fh, indent=2, default=str)
    page = render(report).replace("<title>gradparity report</title>", "<title>gradparity zoo</title>")
    page = page.replace("<h1>gradparity conformance report</h1>", "<h1>gradparity mutant zoo</h1>" + _detection_html(doc), 1)
    with open(paths["html"], "w") as fh:
        fh.write(page)
    return paths


def print_table(doc: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"mutant zoo: detection table (profile {doc['profile']})", show_lines=True)
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


def zoo(profile: str = "quick", *, report_dir: str = "gradparity-reports/zoo", workers: int = 1,
        timeout_scale: float = 0.25, mutants: list[str] | None = None, controls: list[str] | None = None,
        console=None) -> tuple[int, dict]:
    """Run the zoo; returns (exit status, the zoo document written to zoo.json)."""
    from rich.console import Console

    console = console or Console()
    chosen = {n: zoo_mutants.MUTANTS[n] for n in (mutants or zoo_mutants.MUTANTS)}
    controls = list(controls or CONTROLS)
    if BASE not in controls:
        controls.append(BASE)  # the base is what "caught" is judged against
    specs = controls + [registry.ddp_class_spec(path) for path, _ in chosen.values()]
    scenarios = catalogue.select(area="ddp", profile=profile)
    t0 = time.perf_counter()

    def progress(done, total, r):
        mark = {"passed": "✓", "failed": "✗", "xfailed": "x", "xpassed": "!"}.get(r["verdict"], "?")
        fired = f" fired={r['fired']}" if r["fired"] else ""
        console.print(f"[{done:>3}/{total}] {mark} {r['adapter'].removeprefix('ddp-class=conformance.fixtures.mutants.')}"
                      f" | {_short(r['scenario'])} {r['kind']}{fired} ({r['duration_s']:.1f}s)", highlight=False)

    results = run_cases(specs, scenarios, workers=workers, timeout_scale=timeout_scale, progress=progress)
    doc = judge(results, chosen, controls)
    escaped = [row["mutant"] for row in doc["table"] if not row["caught_by"]]
    bad_controls = [spec for spec, c in doc["controls"].items() if c["failed"]]
    doc.update(
        schema=SCHEMA, profile=profile, timeout_scale=timeout_scale, scenarios=[s.id for s in scenarios],
        seconds=round(time.perf_counter() - t0, 1), escaped=escaped, failed_controls=bad_controls,
        summary=(f"{len(chosen) - len(escaped)}/{len(chosen)} mutants caught"
                 + (f" (ESCAPED: {', '.join(escaped)})" if escaped else "")
                 + f"; controls failing: {', '.join(bad_controls) if bad_controls else 'none'}"
                 + f"; {len(scenarios)} scenarios × {len(specs)} implementations in {time.perf_counter() - t0:.0f}s"),
    )
    paths = write_reports(report_dir, doc, results, specs)
    print_table(doc, console)
    console.print(f"zoo json: {paths['json']}\nzoo html: {paths['html']}", highlight=False)
    return (1 if escaped or bad_controls else 0), doc


def cmd_zoo(args) -> int:
    unknown = [m for m in args.mutant if m not in zoo_mutants.MUTANTS]
    if unknown:
        from conformance.cli import UsageError

        raise UsageError(f"unknown mutant {unknown[0]!r}; known: {', '.join(zoo_mutants.MUTANTS)}")
    for spec in args.control:
        registry.load(spec)  # a bad control name is a usage error (AdapterError), before any process
    code, _ = zoo(args.profile, report_dir=args.report_dir, workers=args.workers, timeout_scale=args.timeout_scale,
                  mutants=args.mutant or None, controls=args.control or None)
    return code
