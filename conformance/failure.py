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
from dataclasses import dataclass

from conformance.compare import ConformanceError


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
            return Classified(cls, f"rank {failure.rank}: {first_line(failure.message)}")
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


def run_failed(scenario_id: str, adapter_spec: str, outcome, *, where: str = "", repro: str = "") -> RunFailed:
    """The error a driver raises when `outcome` is not ok: the class first, then every rank's story."""
    classified = classify_outcome(outcome)
    assert classified is not None, "run_failed() on an outcome that is ok"
    head = f"[{scenario_id}] adapter {adapter_spec}: {classified.line()}" + (f" (on {where})" if where else "")
    tail = f"\n  repro: {repro}" if repro else ""
    return RunFailed(f"{head}\n{outcome.render_failures()}{tail}", classified)
