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


def production_features(scenario, unsupported: dict[str, str] | None = None) -> str | None:
    """Why an engine skips a production-training scenario (join, AMP, compile ...), or None.

    The production loop drives every engine, protocol v2 included; what the suite itself cannot
    do for an adapter is decided from its declarations (`conformance.adapters.feature_support`). This is
    the engine's own table: `unsupported` maps a feature (`conformance.features.Features` field
    name) to the reason the engine's documentation gives for not offering it (or for doing it
    its own way, which then has its own scenario family).
    """
    if not getattr(scenario, "features", None) or not unsupported:
        return None
    for name, _ in scenario.features:
        if name in unsupported:
            return unsupported[name]
    return None
