"""`check_model`: the user's own model through the model-independent families, from Python.

    from conformance import check_model
    result = check_model(build, batch, loss=loss, adapters=["torch-ddp"], world_sizes=[2])
    assert result.ok, result.summary

`build`, `batch` and `loss` are module-level functions (or "pkg.module:function" strings): the
rank processes import them (`conformance.models.user`). Everything the user handed in is checked
in this process first (`inspect`: build returns a module, batch gives tensors, forward and
loss run, which generators forward draws from), so a mistake is one line before any process
starts. The cases run exactly as `gradparity run` runs them (`conformance.pipeline.run_case`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from conformance.adapters import registry
from conformance.adapters.protocol import missing_capabilities
from conformance.catalogue import user_model
from conformance.models import data, user
from conformance.pipeline import Case, CaseResult, PoolExecutor, run_case

DEFAULT_ADAPTERS = ("torch-ddp", "refimpl-ddp")
DEFAULT_FAMILIES = user_model.DEFAULT_FAMILIES
NOT_REPLAYABLE = {"python": "Python's random", "numpy": "NumPy's global generator"}


@dataclass
class ModelCheck:
    """What `check_model` found: `.ok`, a printable `.summary`, every case's result."""

    model: str
    notes: list[str] = field(default_factory=list)
    results: list[CaseResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        ran = [r for r in self.results if r.verdict != "skipped"]
        return bool(ran) and all(r.verdict in ("passed", "xfailed") for r in ran)

    @property
    def summary(self) -> str:
        counts: dict[str, int] = {}
        for r in self.results:
            counts[r.verdict] = counts.get(r.verdict, 0) + 1
        head = f"{self.model}: {'conformant' if self.ok else 'NOT CONFORMANT'} (" + ", ".join(
            f"{n} {v}" for v, n in sorted(counts.items())) + ")"
        lines = [head, *(f"  note: {n}" for n in self.notes)]
        for r in self.results:
            mark = {"passed": "ok", "skipped": "skip"}.get(r.verdict, r.verdict.upper())
            first = (r.message or "").splitlines()[0] if r.message and r.verdict != "passed" else ""
            lines.append(f"  {mark:6} {r.case.id}" + (f": {first}" if first else ""))
        return "\n".join(lines)


def user_scenarios(build, batch, loss=None, *, areas=("ddp",), world_sizes=(2,), families=user_model.DEFAULT_FAMILIES,
                   optimizer: str = "sgd", seed: int = 0) -> tuple[list, list[str]]:
    """The user's model's scenarios in `areas` and the notes to print before any process starts;
    raises `UserModelError` (one line) on bad input."""
    refs = [user.ref_of(f, what) for f, what in ((build, "build"), (batch, "batch"))]
    loss_ref = user.ref_of(loss, "loss") if loss is not None else ("", "")
    spec = user.UserModel(refs[0][0], refs[1][0], loss_ref[0], refs[0][1] or refs[1][1] or loss_ref[1])
    seen = user.inspect(spec, data.loss_fn, seed=seed)
    foreign = [NOT_REPLAYABLE[g] for g in seen.randomness if g in NOT_REPLAYABLE]
    if foreign:
        raise user.UserModelError(f"--model {spec.build!r}: forward draws from {' and '.join(foreign)}, which the "
                                  "oracle cannot replay per rank; draw from torch's generator (torch.rand*, dropout)")
    notes = []
    if "torch" in seen.randomness:
        notes.append("forward draws random numbers (dropout): replayed per rank from each rank's recorded stream; "
                     "torch.compile left out (its kernels draw their own masks)")
    if seen.unused:
        notes.append(f"{len(seen.unused)} parameter(s) got no gradient in one forward ({seen.unused[0]} ...): "
                     "run with find_unused_parameters=True")
    out = []
    for area in areas:
        out += user_model.scenarios(spec.encode(), spec.name, world_sizes=tuple(world_sizes), families=tuple(families),
                                    optimizer=optimizer, batch_size=seen.batch_size, find_unused=bool(seen.unused),
                                    randomness=seen.randomness, area=area, has_buffers=seen.has_buffers)
    return out, notes


def prepare(build, batch, loss=None, *, adapters: Sequence[str] = DEFAULT_ADAPTERS, world_sizes=(2,),
            families=user_model.DEFAULT_FAMILIES, optimizer: str = "sgd", seed: int = 0) -> tuple[list[Case], list[str]]:
    """The cases to run and the notes to print first; raises `UserModelError` (one line) on bad input."""
    loaded = {name: registry.load(name) for name in adapters}
    for name, adapter in loaded.items():
        if adapter.area not in ("ddp", "sharded"):
            raise user.UserModelError(f"adapter {name!r} checks the {adapter.area} area; a model runs on ddp or "
                                      "sharded engines")
    areas = tuple(dict.fromkeys(a.area for a in loaded.values()))
    scenarios, notes = user_scenarios(build, batch, loss, areas=areas, world_sizes=world_sizes, families=families,
                                      optimizer=optimizer, seed=seed)
    cases = []
    for name, adapter in loaded.items():
        for s in scenarios:
            if s.area != adapter.area:
                continue
            missing = missing_capabilities(adapter, s.requires)
            skip = f"{adapter.name} lacks capability: {', '.join(c.value for c in missing)}" if missing else ""
            cases.append(Case(s, name, skip=skip))
    return cases, notes


def check_model(build: Callable | str, batch: Callable | str, loss: Callable | str | None = None, *,
                adapters: Sequence[str] = DEFAULT_ADAPTERS, world_sizes: Sequence[int] = (2,),
                families: Sequence[str] = user_model.DEFAULT_FAMILIES, optimizer: str = "sgd",
                timeout_scale: float = 1.0, executor=None) -> ModelCheck:
    """Run the user's model through every model-independent family on every adapter; see the module doc."""
    cases, notes = prepare(build, batch, loss, adapters=adapters, world_sizes=world_sizes, families=families,
                           optimizer=optimizer)
    result = ModelCheck(cases[0].scenario.id.split("/")[2] if cases else str(build), notes)
    own = executor is None
    executor = executor or PoolExecutor(timeout_scale=timeout_scale)
    try:
        result.results = [run_case(case, executor) for case in cases]
    finally:
        if own:
            executor.close()
    return result
