"""The `gradparity` command: `run` wraps pytest; `list` shows scenarios and adapters.

Bad input (unknown adapter, bad import path, impossible world size, unknown profile) gets a
one-line message that says what to do, and exit status 2, before any process is spawned.
"""

from __future__ import annotations

import argparse
import sys

from conformance import catalogue
from conformance.adapters import registry
from conformance.frontends import options
from conformance.judge.failure import EXIT_INFRASTRUCTURE_ONLY, only_infrastructure_errors
from conformance.validation import UsageError

EXIT_INTERRUPTED = 130  # the shell's convention for SIGINT; pytest's own 2 would read as bad input


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments get one line (not the usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"gradparity: error: {message} (see `{self.prog} --help`)\n")


EPILOG = """\
--ddp-class capabilities: a scenario needing a capability the class lacks is skipped with the
capability named. Detected: no_sync (method no_sync), comm_hook (method register_comm_hook),
join (method join), bucket_cap_mb / gradient_as_bucket_view / static_graph / broadcast_buffers /
mixed_precision (constructor keywords). Opt out explicitly with a class attribute, e.g.
    gradparity_capabilities = frozenset({Capability.NO_SYNC})   # from conformance.spec
Exit status: 0 conformant; 1 a failure (wrong value, raised, crashed, hung) or a strict xfail
that passed; 2 bad input (one line, before any process starts), or nothing checked (every case
of the run, or of an adapter named with --adapter/--ddp-class, skipped); 3 no failure, but every
non-pass is an infrastructure error (pool start, rendezvous, the harness: rerun or fix the
machine, not the implementation), or pytest itself failed; 130 interrupted (Ctrl-C)."""


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="gradparity", description="Prove a data-parallel implementation trains like one process.",
                      epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the conformance suite (default: quick profile, built-in adapters, CPU/gloo)",
                         epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_to_argparse(run)  # the same options as the pytest plugin and torchrun (conformance/frontends/options.py)
    run.add_argument("-k", dest="keyword", default=None, help="pytest -k expression over case ids")
    run.add_argument("-n", dest="workers", default=None, help="pytest-xdist workers (a number or 'auto')")
    run.add_argument("-v", "--verbose", action="count", default=0)
    run.add_argument("-x", "--exitfirst", action="store_true")
    run.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    lst = sub.add_parser("list", help="list scenarios and adapters")
    lst.add_argument("--profile", default="full", choices=catalogue.PROFILES)
    lst.add_argument("--area", default=None, choices=options.AREA_CHOICES)
    lst.add_argument("--coverage", action="store_true",
                     help="per adapter and area: feature pairs covered / possible, uncovered pairs with the reason")
    lst.add_argument("--adapter", action="append", default=[], help="with --coverage: these adapters (default: built-in)")
    from conformance.frontends import zoo

    zoo.add_arguments(sub.add_parser("zoo", help="run an area's scenarios against its mutant zoo: is every known-bad implementation caught?"))
    from conformance.frontends import compare_runs

    compare_runs.add_arguments(sub.add_parser("compare", help="compare two recordings (run --record) tensor by tensor",
                                              epilog=compare_runs.EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter))
    return p


def _validate(args) -> list[str]:
    """Every check that can refuse bad input does so here, before pytest or any rank starts."""
    chosen = options.selection(args)
    for note in chosen.notes:  # what the user's model showed in this process (randomness, unused parameters)
        print(f"gradparity: note: {note}", file=sys.stderr)
    return list(chosen.adapters)


def pytest_args(args, specs: list[str]) -> list[str]:
    out = ["--pyargs", "conformance.suite", "-p", "no:cacheprovider", "--profile", args.profile, "--device", args.device,
           "--gradparity-report-dir", args.report_dir,  # JSON, HTML and junit.xml (conformance/report/)
           "--timeout-scale", str(args.timeout_scale)]
    for spec in specs:
        if spec.startswith(registry.DDP_CLASS_PREFIX):
            out += ["--ddp-class", spec[len(registry.DDP_CLASS_PREFIX):]]
        else:
            out += ["--adapter", spec]
    for w in args.world_size:
        out += ["--world-size", str(w)]
    for s in args.scenario:
        out += ["--scenario", s]
    for path in args.xfails:
        out += ["--xfails", path]
    for path in args.skips:
        out += ["--skips", path]
    if args.record:
        out += ["--gradparity-record", args.record]  # conformance/recording.py
    for flag in ("model", "batch", "loss"):  # your own model (docs/your-model.md)
        if getattr(args, flag):
            out += [f"--{flag}", getattr(args, flag)]
    if args.model:
        out += ["--optimizer", args.optimizer] + [a for f in args.family for a in ("--family", f)]
    if args.keyword:
        out += ["-k", args.keyword]
    if args.workers:
        out += ["-n", str(args.workers)]
    if args.exitfirst:
        out.append("-x")
    out += ["-v"] * args.verbose
    return out + list(args.pytest_args)


def cmd_run(args) -> int:

    import pytest

    specs = _validate(args)
    code = pytest.main(pytest_args(args, specs))
    if code == pytest.ExitCode.USAGE_ERROR:  # pytest rejected an argument after `--` (its own message is above)
        print("gradparity: error: pytest rejected the arguments after `--` (see the line above); "
              "see `pytest --help`", file=sys.stderr)
        return 2
    if code == pytest.ExitCode.INTERRUPTED:
        print("gradparity: interrupted: the report lists what ran", file=sys.stderr)
        return EXIT_INTERRUPTED
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        why = ((_report(args.report_dir) or {}).get("run") or {}).get("nothing_checked")
        print(f"gradparity: error: {why}; not a pass (see the skip reasons above)" if why else
              "gradparity: no scenario matched the selection; see `gradparity list`", file=sys.stderr)
        return 2
    if code == pytest.ExitCode.TESTS_FAILED and _only_infrastructure_errors(args.report_dir):
        print("gradparity: no failure, but only infrastructure errors (pool start, rendezvous, harness): "
              f"exit status {EXIT_INFRASTRUCTURE_ONLY}", file=sys.stderr)
        return EXIT_INFRASTRUCTURE_ONLY
    if code == pytest.ExitCode.OK and _judged(args.report_dir) == 0:
        # e.g. `-- --setup-only` or `--collect-only`: nothing was run, so nothing was shown to conform
        print("gradparity: error: no case was run (pytest arguments such as --setup-only or --collect-only "
              "stop before the cases); use `gradparity list` to see cases", file=sys.stderr)
        return 2
    return int(code)


def _judged(report_dir: str) -> int:
    """How many cases the run's JSON report holds (0 when it wrote none)."""
    report = _report(report_dir)
    return len(report.get("results", [])) if report else 0


def _report(report_dir: str) -> dict | None:
    import json
    from pathlib import Path

    from conformance.report import JSON

    try:
        return json.loads((Path(report_dir) / JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _only_infrastructure_errors(report_dir: str) -> bool:
    """What the run's JSON report says (an unreadable report keeps exit status 1)."""
    report = _report(report_dir)
    return report is not None and only_infrastructure_errors(report)


def cmd_list(args) -> int:
    if args.coverage:
        return _list_coverage(args)
    from rich.console import Console
    from rich.markup import escape  # "[pytorch/pytorch#N]" is not rich markup: show it
    from rich.table import Table

    scenarios = catalogue.select(profile=args.profile, area=args.area)
    # piped: wide enough for the longest (generated) id and the columns beside it
    width = max([200] + [len(s.id) + 160 for s in scenarios])
    console = Console(width=None if sys.stdout.isatty() else width, emoji=False)  # user strings stay text
    table = Table(title=f"scenarios (profile {args.profile})")
    table.add_column("id", no_wrap=True)  # ids are copied into --scenario: never truncate them
    for col in ("profiles", "requires", "tolerance", "about"):
        table.add_column(col)
    for s in scenarios:
        about = s.description + (f" [{s.upstream}]" if s.upstream else "")
        table.add_row(escape(s.id), next(p for p in catalogue.PROFILES if p in s.profiles) + "+",
                      ", ".join(sorted(c.value for c in s.requires)), escape(s.tolerance.describe()), escape(about))
    console.print(table)
    adapters = Table(title="adapters")
    for col in ("name", "area", "version", "capabilities"):
        adapters.add_column(col)
    for name in sorted(registry.known_adapters()):
        try:
            a = registry.load(name)
            adapters.add_row(escape(name), a.area, escape(str(getattr(a, "version", ""))),
                             ", ".join(sorted(c.value for c in a.capabilities)))
        except Exception as exc:  # an optional dependency may be missing: say so, keep listing
            adapters.add_row(escape(name), "?", "unavailable", escape(str(exc).splitlines()[0][:80]))
    console.print(adapters)
    return 0


def cmd_zoo(args) -> int:
    from conformance.frontends.zoo import cmd_zoo as run_zoo

    return run_zoo(args)


def cmd_compare(args) -> int:
    from conformance.frontends.compare_runs import cmd_compare as run_compare

    return run_compare(args)


def _list_coverage(args) -> int:
    """`list --coverage`: the pair coverage table, then every uncovered and excluded pair with why."""
    from conformance import coverage

    areas = (args.area,) if args.area else ()
    records = coverage.per_adapter(args.profile, tuple(args.adapter), areas)
    print(f"pair coverage, profile {args.profile}")
    for r in records:
        if "error" in r:
            print(f"  {r['adapter']:<28} {r['area']:<8} unavailable: {r['error']}")
            continue
        print(f"  {r['adapter']:<28} {r['area']:<8} {r['covered']}/{r['possible']} pairs covered, "
              f"{r['excluded']} excluded by constraints")
    for r in records:
        for u in r.get("uncovered", []):
            pair = ", ".join(f"{k}={v}" for k, v in u["pair"].items())
            print(f"uncovered {r['adapter']} {r['area']}: {pair}: {u['why']}")
    for area in sorted({r["area"] for r in records}):
        for e in coverage.exclusions(area):
            pair = ", ".join(f"{k}={v}" for k, v in e["pair"].items())
            print(f"excluded {area}: {pair}: {'/'.join(e['constraints'])}")
    return 0


COMMANDS = {"run": cmd_run, "list": cmd_list, "zoo": cmd_zoo, "compare": cmd_compare}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command](args)
    except (UsageError, registry.AdapterError) as exc:
        print(f"gradparity: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
