"""The suite's options, defined once: `gradparity run`'s argparse, the pytest plugin's options
and the torchrun launcher's arguments are all built from `OPTIONS`, and every front end turns
the parsed values into a `conformance.plan.Selection` through `selection()`, which validates them
(`conformance.validation`) — one definition, one set of checks, one message per mistake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conformance import catalogue
from conformance.area import NAMES as AREA_CHOICES

DEFAULT_REPORT_DIR = "gradparity-reports"
__all__ = ["AREA_CHOICES", "DEFAULT_REPORT_DIR", "OPTIONS", "add_to_argparse", "add_to_pytest", "selection"]


@dataclass(frozen=True)
class Option:
    flag: str
    help: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    choices: tuple[str, ...] | None = None  # argparse checks them; pytest leaves it to validation (one line, exit 2)
    pytest_flag: str | None = None  # where pytest's own options would clash
    pytest_default: Any = ...  # the plugin's default, where it differs

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


OPTIONS: tuple[Option, ...] = (
    Option("--adapter", "adapter name or pkg.module:factory (repeatable)", {"action": "append", "default": []}),
    Option("--ddp-class", "pkg.module:Class following torch DDP's constructor (repeatable)",
           {"action": "append", "default": []}),
    Option("--profile", "scenario profile: quick (default), standard or full", {"default": "quick"},
           choices=catalogue.PROFILES),
    Option("--scenario", "exactly this scenario id (repeatable)", {"action": "append", "default": []}),
    Option("--world-size", "only these world sizes (repeatable)", {"action": "append", "type": int, "default": []}),
    Option("--device", "cpu (default) or cuda", {"default": "cpu"}, choices=("cpu", "cuda")),
    Option("--xfails", "expected-failures file: case or node ids, '#' reasons (repeatable)",
           {"action": "append", "default": []}),
    Option("--skips", "file of cases to skip: case or node ids, '#' reasons (repeatable)",
           {"action": "append", "default": []}),
    Option("--report-dir", f"where reports go (default {DEFAULT_REPORT_DIR}/)", {"default": DEFAULT_REPORT_DIR},
           pytest_flag="--gradparity-report-dir", pytest_default=None),
    Option("--timeout-scale", "multiply every scenario's timeout (slow machines)", {"type": float, "default": 1.0}),
    Option("--record", "record every judged tensor (values, digests, provenance) into DIR, for `gradparity compare`",
           {"default": None, "metavar": "DIR"}, pytest_flag="--gradparity-record"),
)


def add_to_argparse(parser) -> None:
    for o in OPTIONS:
        parser.add_argument(o.flag, help=o.help, choices=o.choices, **o.kwargs)


def add_to_pytest(group) -> None:
    for o in OPTIONS:
        kwargs = dict(o.kwargs)
        if o.pytest_default is not ...:
            kwargs["default"] = o.pytest_default
        group.addoption(o.pytest_flag or o.flag, dest=o.dest, help=o.help, **kwargs)


def selection(values, *, areas=(), check_reports: bool = True):
    """Validated values (an argparse namespace, or pytest's config.option) as a `Selection`.

    Raises `conformance.validation.UsageError` (one line: what to do) on bad input."""
    from conformance.adapters import registry
    from conformance.plan import Selection
    from conformance.validation import validate

    specs = list(values.adapter) + [registry.ddp_class_spec(ref) for ref in values.ddp_class]
    chosen = Selection(adapters=tuple(specs), profile=values.profile, areas=tuple(areas),
                       world_sizes=tuple(values.world_size), device=values.device, ids=tuple(values.scenario),
                       xfail_files=tuple(values.xfails), skip_files=tuple(values.skips),
                       keyword=getattr(values, "keyword", None) or "")
    validate(chosen, report_dir=values.report_dir if check_reports else None)
    if check_reports and getattr(values, "record", None):
        from conformance.recording import check_directory

        check_directory(values.record)
    return chosen
