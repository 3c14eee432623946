"""Module paths of refimpl that moved, kept importing for one minor version with a warning.

refimpl 0.1.0 had flat modules (`refimpl.bucketer`, `refimpl.reducer`, ...); they moved into
one package per engine (`refimpl.ddp`, `refimpl.sharded`, ...). Code written against 0.1.0 keeps
working through 0.2.x: each old path is a module of two lines that calls `reexport`, which warns
(a `DeprecationWarning` naming the new path) and copies the new module's names. They are
removed in `REMOVED_IN`. docs/refimpl-api.md lists them; tests/refimpl/test_public_api.py
imports each one and checks the warning.
"""

from __future__ import annotations

import importlib
import warnings

REMOVED_IN = "0.3.0"

# old module path -> where its names live now
MOVED = {
    "refimpl.bucketer": "refimpl.sharded.bucketer",
    "refimpl.bucketing": "refimpl.ddp.plan",
    "refimpl.comm_hooks": "refimpl.ddp.comm_hooks",
    "refimpl.join": "refimpl.ddp.join",
    "refimpl.mixed_precision": "refimpl.ddp.mixed_precision",
    "refimpl.reducer": "refimpl.ddp.reducer",
    "refimpl.reducer_buckets": "refimpl.ddp.buckets",
    "refimpl.reducer_stats": "refimpl.ddp.stats",
    "refimpl.sparse_reduce": "refimpl.ddp.sparse",
    "refimpl.unused_params": "refimpl.ddp.unused_params",
    "refimpl.data_parallel.data_parallel": "refimpl.data_parallel.forward",
}
# names that were renamed as they moved: old path -> {old name: new name}
RENAMED = {"refimpl.bucketer": {"BucketState": "StagingState"}}


class MovedModules:
    """One package's moved module paths: the message naming the new path, and the shim's body.

    conformance's moved paths (`conformance._deprecated`) use the same class with their own tables.
    """

    def __init__(self, project: str, removed_in: str, moved: dict[str, str],
                 renamed: dict[str, dict[str, str]]) -> None:
        self.project, self.removed_in, self.moved, self.renamed = project, removed_in, moved, renamed

    def message(self, old: str) -> str:
        return (f"{old} is deprecated and will be removed in {self.project} {self.removed_in}: "
                f"import {self.moved[old]} instead")

    def reexport(self, old: str, namespace: dict) -> None:
        """Warn that `old` moved, then give its module namespace every name of the new module."""
        # 3: the importing code (past this method and the shim; warnings skips importlib's frames)
        warnings.warn(self.message(old), DeprecationWarning, stacklevel=3)
        module = importlib.import_module(self.moved[old])
        namespace.update({k: v for k, v in vars(module).items() if not (k.startswith("__") and k.endswith("__"))})
        for old_name, new_name in self.renamed.get(old, {}).items():
            namespace[old_name] = getattr(module, new_name)


_PATHS = MovedModules("refimpl", REMOVED_IN, MOVED, RENAMED)
message = _PATHS.message
reexport = _PATHS.reexport
