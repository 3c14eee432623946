"""The failure taxonomy: every non-pass is one of five classes, each with a one-line cause.

Why one module: the pytest plugin, `gradparity zoo` and the torchrun launcher each run cases
their own way, but a user reading any of their reports must see the same words for the same
event. They all classify here.

- wrong value     a contract check failed (the implementation ran and produced a wrong number)
- raised          the implementation raised on some rank
- crashed         a rank process died (signal or exit status)
- hung            a rank gave no answer in time (reported with its Python stack)
- infrastructure  the pool could not start, the rendezvous failed, or the harness failed before
                  the implementation ran; retried once on a fresh pool, then reported as an
                  `error` (never `failed`, never a pass)

When several ranks fail differently, the most telling class wins: a crash explains a peer's
"connection closed" error, a raise explains a peer waiting forever in a collective.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from conformance.judge.compare import ConformanceError


class FailureClass(str, enum.Enum):
    WRONG_VALUE = "wrong value"
    RAISED = "raised"
    CRASHED = "crashed"
    HUNG = "hung"
    INFRASTRUCTURE = "infrastructure"

    @property
    def verdict(self) -> str:
        """pytest's word for it: an infrastructure problem is an `error`, everything else `failed`."""
        return "error" if self is FailureClass.INFRASTRUCTURE else "failed"


# RankFailure.kind -> class; the order of PRECEDENCE decides which rank's story is told.
KIND_CLASS = {
    "died": FailureClass.CRASHED,
    "raised": FailureClass.RAISED,
    "timeout": FailureClass.HUNG,
    "no-answer": FailureClass.HUNG,
    "infrastructure": FailureClass.INFRASTRUCTURE,
}
PRECEDENCE = (FailureClass.CRASHED, FailureClass.RAISED, FailureClass.HUNG, FailureClass.INFRASTRUCTURE)


@dataclass(frozen=True)
class Classified:
    failure_class: FailureClass
    cause: str  # one line

    def line(self) -> str:
        return f"{self.failure_class.value}: {self.cause}"


def first_line(text: str, limit: int = 300) -> str:
    for line in (text or "").strip().splitlines():
        if line.strip():
            return line.strip()[:limit]
    return ""


# What a dead rank's log says about why it died, most telling first. A rank that raises in
# Python answers with its exception; one that dies leaves these in its log (the pool starts
# faulthandler in every rank, so a fatal signal prints "Fatal Python error: ..." and the stack).
_FATAL = re.compile(r"^(Fatal Python error: .+|terminate called .+|\s*what\(\):\s*.+|Killed|Segmentation fault.*|Aborted.*)$")
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)(?:: .*)?$")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')


def crash_clue(text: str, limit: int = 240) -> str:
    """The most telling line of a dead rank's log: a fatal error / C++ abort, else the last
    exception line, else ""."""
    lines = [line.rstrip() for line in (text or "").splitlines() if line.strip()]
    fatal = [line.strip() for line in lines if _FATAL.match(line)]
    if fatal:  # "terminate called after throwing ..." is followed by its "what():" line: keep both
        return " ".join(fatal[:2])[:limit]
    exceptions = [line.strip() for line in lines if _EXCEPTION.match(line.strip())]
    return exceptions[-1][:limit] if exceptions else ""


def stuck_at(stack: str, *, need_header: bool = False) -> str:
    """Where a rank's thread was: the innermost frame of faulthandler's dump (`fn (file.py:N)`),
    or "" when there is no stack. `need_header`: only from a dump whose "Current thread" header
    survived (a log tail may have cut off the innermost frames of a deep stack)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x|Stack \(most recent call first\))", stack or "")
    current = [b for b in blocks if b.lstrip().startswith(("Current thread", "Stack (most recent call first)"))]
    if need_header and not current:
        return ""
    main = current[-1] if current else (blocks[-1] if blocks else "")
    for line in main.splitlines():  # faulthandler lists the most recent call first
        m = _FRAME.match(line)
        if m:
            return f"{m.group('fn')} ({m.group('file').rsplit('/', 1)[-1]}:{m.group('line')})"
    return ""


def _cause(failure) -> str:
    """`rank N: <message's first line>`, plus, for a death, the log's clue and, for a hang, where
    the rank was waiting: the one line a terminal summary shows must say why, not only that."""
    cause = f"rank {failure.rank}: {first_line(failure.message)}"
    if failure.kind == "died":
        clue = crash_clue(f"{failure.log_tail}\n{failure.traceback}")
        where = stuck_at(failure.log_tail, need_header=True) if clue.startswith("Fatal Python error") else ""
        clue += f" in {where}" if where else ""
        return f"{cause}; log: {clue}" if clue else cause
    if failure.kind in ("timeout", "no-answer"):
        where = stuck_at(failure.stack)
        return f"{cause}; stuck in {where}" if where else cause
    if failure.kind == "infrastructure":
        clue = crash_clue(f"{failure.message}\n{failure.log_tail}\n{failure.traceback}")
        return f"{cause}; {clue}" if clue and clue not in cause else cause
    return cause


def classify_outcome(outcome) -> Classified | None:
    """The class and cause of a task outcome (`harness.pool.TaskOutcome`); None when it is ok.

    Infrastructure only when *every* failing rank failed before the implementation ran: one
    rank raising while another could not be reached is the implementation's failure.
    """
    if outcome.ok:
        return None
    by_class: dict[FailureClass, list] = {}
    for _rank, failure in sorted(outcome.failures.items()):
        by_class.setdefault(KIND_CLASS.get(failure.kind, FailureClass.INFRASTRUCTURE), []).append(failure)
    for cls in PRECEDENCE:
        if cls is FailureClass.INFRASTRUCTURE and len(by_class) > 1:
            continue
        if cls in by_class:
            failure = by_class[cls][0]
            return Classified(cls, _cause(failure))
    raise AssertionError("unreachable: a failed outcome with no classified failure")


def classify_exception(exc: BaseException) -> Classified:
    """The class of whatever ended a case: a classified error keeps its class; a contract
    violation is a wrong value; anything else escaped the harness itself (infrastructure)."""
    cls = getattr(exc, "failure_class", None)
    if isinstance(cls, FailureClass):
        return Classified(cls, getattr(exc, "cause", "") or first_line(str(exc)))
    if isinstance(exc, ConformanceError):
        return Classified(FailureClass.WRONG_VALUE, first_line(str(exc)))
    return Classified(FailureClass.INFRASTRUCTURE, f"the harness raised {type(exc).__name__}: {first_line(str(exc))}")


class RunFailed(ConformanceError):
    """A task whose ranks did not all answer: carries the class and cause of the outcome."""

    def __init__(self, message: str, classified: Classified):
        super().__init__(message)
        self.failure_class = classified.failure_class
        self.cause = classified.cause


class ImplementationRaised(ConformanceError):
    """The implementation raised where the coordinator itself called it (single-process areas)."""

    failure_class = FailureClass.RAISED

    def __init__(self, message: str, exc: BaseException):
        super().__init__(message)
        self.cause = f"{type(exc).__name__}: {first_line(str(exc))}"


class RanksRaised(ConformanceError):
    """Some ranks' implementation raised, so their records stop short (the DDP-family judge):
    a raise, not a wrong value; the cause names the first rank's exception."""

    failure_class = FailureClass.RAISED

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


def run_failed(scenario_id: str, adapter_spec: str, outcome, *, where: str = "", repro: str = "") -> RunFailed:
    """The error a driver raises when `outcome` is not ok: the class first, then every rank's story."""
    classified = classify_outcome(outcome)
    assert classified is not None, "run_failed() on an outcome that is ok"
    head = f"[{scenario_id}] adapter {adapter_spec}: {classified.line()}" + (f" (on {where})" if where else "")
    tail = f"\n  repro: {repro}" if repro else ""
    return RunFailed(f"{head}\n{outcome.render_failures()}{tail}", classified)


# `gradparity run`'s exit status when the run judged nothing wrong in the implementation but
# could not judge all of it: every non-pass is an infrastructure error (pool start, rendezvous,
# the harness). pytest's own internal error is 3 as well: in both, the run has no verdict.
EXIT_INFRASTRUCTURE_ONLY = 3


def only_infrastructure_errors(report: dict) -> bool:
    """Whether a finished run's only non-passes are infrastructure errors (from its JSON report).

    Nothing failed, no strict xfail passed, and every `error` case is of class infrastructure.
    """
    summary = report.get("summary") or {}
    errors = [r for r in report.get("results") or [] if r.get("verdict") == "error"]
    return (bool(errors) and not summary.get("failed") and not summary.get("xpassed")
            and all(r.get("failure_class") == FailureClass.INFRASTRUCTURE.value for r in errors))
