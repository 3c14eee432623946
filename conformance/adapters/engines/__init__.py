"""Built-in adapters for third-party data-parallel engines, one module per engine.

Each loads its engine only when a scenario runs; when the engine is not installed every
scenario is skipped with the import error and the install command (never passed). The extra
`gradparity[engines]` (or one per engine) installs them CPU-only with torch pinned; see
docs/compatibility.md for what each one showed.
"""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import PackageNotFoundError, version


@functools.cache
def probe(module: str, distribution: str, install: str) -> tuple[str, str | None]:
    """(version, None) when `module` imports; ("not installed", why + install command) otherwise."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is the skip reason
        return "not installed", f"{distribution} cannot be imported ({type(exc).__name__}: {exc}); install: {install}"
    try:
        return version(distribution), None
    except PackageNotFoundError:
        return "unknown", None


def production_features(scenario) -> str | None:
    """Why an engine adapter skips the production-training scenarios (join, AMP, compile ...)."""
    if getattr(scenario, "features", None):
        return ("the production-training scenarios' loop and oracle (runners/ddp_features.py, baseline_features.py) "
                "model torch DDP's semantics with a user-owned optimizer only (no declared semantics, no protocol v2)")
    return None
