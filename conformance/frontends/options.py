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
    # Your own model (docs/your-model.md): the model-independent families instead of the catalogue
    Option("--model", "your model: pkg.module:build, a function returning your nn.Module (with --batch)",
           {"default": None}),
    Option("--batch", "your data: pkg.module:batch, batch(rank, step, micro) -> inputs or (inputs, target)",
           {"default": None}),
    Option("--loss", "your loss: pkg.module:loss, loss(output, target) -> scalar (default: a weighted sum of outputs)",
           {"default": None}),
    Option("--optimizer", "the optimizer of your model's plain families: sgd (default) or adam", {"default": "sgd"},
           choices=("sgd", "adam")),
    Option("--family", "with --model: only these families (repeatable; default all but compile-model)",
           {"action": "append", "default": []}),
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
    if getattr(values, "model", None) or getattr(values, "batch", None):
        chosen = _with_user_model(values, chosen)
    validate(chosen, report_dir=values.report_dir if check_reports else None)
    if check_reports and getattr(values, "record", None):
        from conformance.recording import check_directory

        check_directory(values.record)
    return chosen


def _with_user_model(values, chosen):
    """`--model/--batch/--loss`: the user's model's scenarios for the selected ddp and sharded
    adapters (default: torch-ddp and refimpl-ddp), checked in this process first (one line, exit 2)."""
    from dataclasses import replace

    from conformance.adapters import registry
    from conformance.frontends import model_check
    from conformance.models.user import UserModelError
    from conformance.validation import UsageError

    if not (values.model and values.batch):
        raise UsageError("--model and --batch go together: --model pkg.module:build --batch pkg.module:batch")
    if chosen.ids:
        raise UsageError("--scenario picks catalogue scenarios; with --model use --family and --world-size")
    specs = chosen.adapters or model_check.DEFAULT_ADAPTERS
    try:
        areas = tuple(dict.fromkeys(registry.load(spec).area for spec in specs))
    except registry.AdapterError as exc:
        raise UsageError(str(exc)) from None
    if not set(areas) & {"ddp", "sharded"}:
        raise UsageError("--model runs on ddp or sharded adapters (e.g. --adapter torch-ddp)")
    try:
        scenarios, notes = model_check.user_scenarios(
            values.model, values.batch, values.loss, areas=tuple(a for a in areas if a in ("ddp", "sharded")),
            world_sizes=tuple(values.world_size) or (2,), families=tuple(values.family) or model_check.DEFAULT_FAMILIES,
            optimizer=values.optimizer)
    except (UserModelError, ValueError) as exc:
        raise UsageError(str(exc).splitlines()[0]) from None
    return replace(chosen, adapters=tuple(specs), user_scenarios=tuple(scenarios), notes=tuple(notes),
                   builtin_xfails=False, world_sizes=())
