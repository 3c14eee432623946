"""Bad input is refused before any work: one line that says what to do, exit status 2.

Used by `gradparity run` (before pytest starts), by the pytest plugin (for plain
`pytest --pyargs conformance.suite ...`) and by `gradparity zoo`, so the same mistake gets the
same message whichever door it came through. Nothing here spawns a process or joins a group:
every check reads files, signatures and the catalogue, and takes well under a second.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter

from conformance import catalogue


class UsageError(Exception):
    """Bad input: the message is one line and says what to do."""


def check_profile(profile: str) -> None:
    if profile not in catalogue.PROFILES:
        raise UsageError(f"unknown profile {profile!r}; choose one of {', '.join(catalogue.PROFILES)}")


def check_report_dir(path: str) -> None:
    """The report directory must be creatable and writable now, not after an hour of running."""
    created, parent = [], os.path.abspath(path)
    while not os.path.exists(parent):
        created.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".gradparity-write-check-"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write reports to {path!r} ({exc.strerror or exc}); pass a writable --report-dir") from None
    finally:
        for directory in created:  # leave no trace: the run creates it again when it writes
            try:
                os.rmdir(directory)
            except OSError:
                pass


def check_expectations_file(path: str) -> None:
    """An xfails/skips file must exist and be UTF-8 text (one case or node id per line)."""
    if not os.path.exists(path):
        raise UsageError(f"expectations file {path!r} does not exist")
    if not os.path.isfile(path):
        raise UsageError(f"expectations file {path!r} is not a regular file; pass a text file of case ids")
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise UsageError(f"cannot read expectations file {path!r} ({exc.strerror or exc}); check its permissions") from None
    problem = None
    nul = data.find(b"\0")
    if nul >= 0:
        problem = f"byte {nul} is NUL"
    else:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            problem = f"byte {exc.start} is not UTF-8"
    if problem:
        raise UsageError(f"expectations file {path!r} is not a text file ({problem}); it needs one case id per line, '#' comments")


def check_world_sizes(profile: str, world_sizes: list[int], adapters: dict[str, object], device: str = "cpu",
                      ids: list[str] = ()) -> None:
    """Every chosen adapter must keep at least one scenario; if a world size empties it, say where it is.

    `adapters` maps spec -> loaded adapter. Without --world-size nothing can be dropped here.
    """
    for w in world_sizes:
        if not 1 <= w <= 64:
            raise UsageError(f"impossible world size {w}; use 1..64 (the catalogue has 1, 2, 3 and 4)")
    if not world_sizes or ids:  # explicit scenario ids pick scenarios whatever their profile
        return
    chosen = catalogue.select(profile=profile, world_sizes=world_sizes, device=device)
    by_area = Counter(s.area for s in chosen)
    for spec, adapter in adapters.items():
        area = getattr(adapter, "area", None)
        if by_area.get(area):
            continue
        sizes = ", ".join(map(str, sorted(set(world_sizes))))
        elsewhere = []
        for other in catalogue.PROFILES:
            if other != profile:
                n = sum(1 for s in catalogue.select(profile=other, world_sizes=world_sizes, device=device) if s.area == area)
                if n:
                    elsewhere.append(f"--profile {other} has {n}")
        hint = ("; " + ", ".join(elsewhere)) if elsewhere else "; no profile has one"
        raise UsageError(f"profile {profile} has no {area} scenario at world size {sizes} for adapter {spec}{hint}")


def validate(selection, *, report_dir: str | None = None) -> dict[str, object]:
    """Every check that can refuse a `conformance.plan.Selection`, cheapest first; returns the
    loaded adapters by spec. Used by `gradparity run`, the pytest plugin and torchrun alike."""
    from conformance.adapters import registry

    check_profile(selection.profile)
    if selection.device not in ("cpu", "cuda"):
        raise UsageError(f"unknown device {selection.device!r}; use cpu or cuda")
    if report_dir:
        check_report_dir(report_dir)
    for path in selection.xfail_files + selection.skip_files:
        check_expectations_file(path)
    adapters = {}
    for spec in selection.specs:
        try:
            adapters[spec] = registry.load(spec)
        except registry.AdapterError as exc:
            raise UsageError(str(exc)) from None
    if selection.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda but no CUDA device is visible; use --device cpu or run on a GPU machine")
    if selection.ids:
        known = {s.id for s in catalogue.all_scenarios()}
        unknown = [s for s in selection.ids if s.removesuffix("/cuda") not in known]
        if unknown:
            raise UsageError(f"unknown scenario {unknown[0]!r}; see `gradparity list`")
    if not getattr(selection, "user_scenarios", ()):  # the user's model: its scenarios are built for the sizes asked
        check_world_sizes(selection.profile, list(selection.world_sizes), adapters, selection.device,
                          ids=list(selection.ids))
    return adapters
