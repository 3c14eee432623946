"""An adapter's verdict over its cases, and when a run checked nothing: one rule for every report.

The terminal table, the HTML page, the JSON report and the exit status read the same answer from
here, so a skipped case is never shown as a pass anywhere:

- **not conformant**: a failure, or a strict expected failure that passed;
- **no verdict**: no failure, but an infrastructure error (the machine, not the implementation);
- **incomplete**: the run ended before every case ran;
- **nothing checked**: every case of the adapter was skipped (a capability it lacks, a device
  the machine has not): nothing was shown to conform, so it is not green;
- **conformant**: at least one case ran and none failed.

A run in which no case ran, or in which an adapter named on the command line (`--adapter`,
`--ddp-class`) checked nothing, exits with status 2 and the reason (`exit_reason`); an adapter
that only the default selection brought in (torch's CUDA-only `DataParallel` on a CPU machine)
gets its verdict and does not fail the run.
"""

from __future__ import annotations

from collections import Counter, defaultdict

CONFORMANT, NOT_CONFORMANT, NO_VERDICT = "conformant", "NOT CONFORMANT", "NO VERDICT"
INCOMPLETE, NOTHING_CHECKED = "incomplete", "nothing checked"
RAN = ("passed", "failed", "error", "xfailed", "xpassed")  # verdicts of a case that ran


def adapter_verdict(counts: Counter, *, stopped: bool = False) -> str:
    if counts["failed"] + counts["xpassed"]:
        return NOT_CONFORMANT
    if counts["error"]:
        return NO_VERDICT
    if stopped:  # cases that never ran cannot be called conformant
        return INCOMPLETE
    if not sum(counts[v] for v in RAN):
        return NOTHING_CHECKED
    return CONFORMANT


def by_adapter(results: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        out[r["adapter"]].append(r)
    return dict(out)


def adapter_verdicts(results: list[dict], *, stopped: bool = False) -> dict[str, str]:
    return {a: adapter_verdict(Counter(r["verdict"] for r in rs), stopped=stopped)
            for a, rs in sorted(by_adapter(results).items())}


def skip_reasons(results: list[dict], limit: int = 3) -> str:
    """`N: reason` for the most common skip reasons of `results`, most common first."""
    reasons = Counter((r.get("message") or "no reason given").strip().splitlines()[0] for r in results
                      if r["verdict"] == "skipped")
    text = "; ".join(f"{n}: {why}" for why, n in reasons.most_common(limit))
    return text + (f"; and {len(reasons) - limit} other reason(s)" if len(reasons) > limit else "")


def nothing_checked(results: list[dict]) -> dict[str, str]:
    """Each adapter whose every case was skipped, with why (its skip reasons)."""
    return {a: f"all {len(rs)} case(s) skipped ({skip_reasons(rs)})"
            for a, rs in sorted(by_adapter(results).items())
            if rs and adapter_verdict(Counter(r["verdict"] for r in rs)) == NOTHING_CHECKED}


def exit_reason(results: list[dict], named: list[str]) -> str | None:
    """One line when the run must exit 2 because nothing was checked, else None."""
    if results and not any(r["verdict"] in RAN for r in results):
        return f"nothing checked: every case of the run was skipped ({skip_reasons(results)})"
    empty = {a: why for a, why in nothing_checked(results).items() if a in named}
    if empty:
        return "nothing checked for " + "; ".join(f"{a}: {why}" for a, why in empty.items())
    return None
