"""What a report needs to say which run it is: the command, the suite's commit, adapter versions.

Why here and not in each front end: `gradparity run` (pytest), `gradparity zoo` and the torchrun
launcher all write the same reports, and a CI user comparing two of them must find the same
provenance in the same keys. Nothing here may fail a run: every probe is cheap (one `git`
call with a short timeout, one metadata scan) and falls back to "unknown".

- command      how the run was started, as a shell line (`python -m pkg.mod` when run with -m)
- commit       the suite's git commit: `git rev-parse HEAD` when the package sits at the root
               of a git checkout (an editable install from a clone); else the commit pip
               recorded for a VCS install (PEP 610 `direct_url.json`); else None, with the
               installed distribution's version beside it
- versions     an adapter's version: the adapter's own `version` for built-ins (torch's for
               torch-*, the engine's for deepspeed/fairscale/pfn); for `--ddp-class` the version
               of the distribution that ships the class's top-level package
"""

from __future__ import annotations

import functools
import importlib.metadata as metadata
import json
import os
import platform
import shlex
import subprocess
import sys

GIT_TIMEOUT_S = 5.0


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it again: `python -m pkg.mod args` for `-m` runs.

    Under torchrun the rank's own command is `python -m …`; the launcher is named in front
    (`torchrun -m …`), with the world in `launcher()`.
    """
    if argv is not None:
        return shlex.join(argv)
    argv = list(sys.argv)
    if not argv:
        return ""
    module = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)
    if module and module.endswith(".__main__"):
        module = module[: -len(".__main__")]
    if module:
        head = ["torchrun" if os.environ.get("TORCHELASTIC_RUN_ID") else "python", "-m", module]
    else:
        head = [os.path.basename(argv[0]) or argv[0]]
    return shlex.join(head + argv[1:])


def launcher() -> str:
    """`torchrun (world W, L per node)` under torchrun's elastic agent, else `local`."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return "local"
    return f"torchrun (world {os.environ.get('WORLD_SIZE', '?')}, {os.environ.get('LOCAL_WORLD_SIZE', '?')} per node)"


def _git_commit(source_root: str) -> tuple[str, bool] | None:
    """(HEAD, dirty) when `source_root` is the top of a git checkout; None otherwise.

    The top-level check matters: a package installed into a virtual environment that itself sits
    inside some other repository must not report that repository's commit.
    """
    if not os.path.exists(os.path.join(source_root, ".git")):  # a directory, or a file in a worktree
        return None
    try:
        head = subprocess.run(["git", "-C", source_root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=False)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        status = subprocess.run(["git", "-C", source_root, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip(), bool(status.returncode == 0 and status.stdout.strip())


def _recorded_commit(distribution: str) -> str | None:
    """The commit pip recorded for a VCS install (PEP 610), if any."""
    try:
        text = metadata.distribution(distribution).read_text("direct_url.json")
        return (json.loads(text or "{}").get("vcs_info") or {}).get("commit_id")
    except (metadata.PackageNotFoundError, ValueError, OSError):
        return None


@functools.cache
def suite_provenance() -> dict:
    """{'version', 'commit', 'commit_source', 'dirty'} for the installed suite (cached per process)."""
    from conformance import _version
    from conformance._version import __version__

    info = {"version": __version__, "commit": None, "commit_source": None, "dirty": None}
    try:
        info["distribution_version"] = metadata.version("gradparity")
    except metadata.PackageNotFoundError:
        info["distribution_version"] = None
    root = os.path.dirname(os.path.dirname(os.path.abspath(_version.__file__)))
    found = _git_commit(root)
    if found:
        info["commit"], info["dirty"] = found
        info["commit_source"] = "git checkout"
    else:
        recorded = _recorded_commit("gradparity")
        if recorded:
            info["commit"], info["commit_source"] = recorded, "pip direct_url.json"
    return info


@functools.cache
def distribution_version(module_name: str) -> str | None:
    """The version of the installed distribution that provides top-level package `module_name`."""
    top = module_name.split(".")[0]
    try:
        names = metadata.packages_distributions().get(top) or [top]
    except Exception:  # noqa: BLE001 - a broken metadata entry elsewhere must not fail a report
        names = [top]
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def adapter_version(spec: str, adapter) -> str:
    """The version a report shows for an adapter; "unknown" when nothing says.

    `--ddp-class pkg.mod:Cls`: the class's own `__version__` if it declares one, else the version
    of the distribution shipping `pkg` (what `pip show` would print), else `pkg.__version__`.
    """
    from conformance.adapters.registry import DDP_CLASS_PREFIX

    if spec.startswith(DDP_CLASS_PREFIX):
        cls = getattr(adapter, "cls", None)
        own = getattr(cls, "__version__", None) if cls is not None else None
        if isinstance(own, str) and own:
            return own
        module = spec[len(DDP_CLASS_PREFIX):].partition(":")[0]
        found = distribution_version(module)
        if found:
            return found
        top = sys.modules.get(module.split(".")[0])
        version = getattr(top, "__version__", None)
        return str(version) if version else "unknown"
    version = getattr(adapter, "version", None)
    return str(version) if version not in (None, "") else "unknown"


def collect(*, profile: str | None = None, backend: str | None = None, device: str | None = None,
            adapters: list[str] = (), argv: list[str] | None = None) -> dict:
    """The run's provenance as the JSON report stores it under `run_info` (and JUnit's properties)."""
    import torch

    suite = suite_provenance()
    return {
        "command": command_line(argv),
        "argv": list(sys.argv if argv is None else argv),
        "launcher": launcher(),
        "cwd": os.getcwd(),
        "suite_version": suite["version"],
        "commit": suite["commit"],
        "commit_source": suite["commit_source"],
        "dirty": suite["dirty"],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "profile": profile,
        "backend": backend,
        "device": device,
        "adapters": list(adapters),
        "adapter_versions": {spec: _loaded_version(spec) for spec in adapters},
    }


def _loaded_version(spec: str) -> str:
    from conformance.adapters import registry

    try:
        return adapter_version(spec, registry.load(spec))
    except Exception:  # noqa: BLE001 - an adapter that cannot load still gets a report row
        return "unknown"
