"""What the moved-module tests of refimpl and of the suite check: an old path warns, naming the
new path and the version it goes in, and gives the new module's names (the same objects)."""

from __future__ import annotations

import importlib
import sys
import warnings


def assert_moved_path_works(old: str, moved: dict[str, str], removed_in: str, *, fresh: bool = True) -> None:
    """Import `old` (afresh, unless `fresh` is false: a module whose re-import would replace a name
    its package exports), with `moved` and `removed_in` from the package's `_deprecated`."""
    new = importlib.import_module(moved[old])
    public = [n for n in dir(new) if not n.startswith("_")]
    assert public, f"{new.__name__} has no public name to check"
    saved = sys.modules.pop(old, None) if fresh else None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shim = importlib.import_module(old)
            values = {n: getattr(shim, n) for n in public}
    finally:
        if saved is not None:
            sys.modules[old] = saved
    assert all(values[n] is getattr(new, n) for n in public)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert messages and all(moved[old] in m and removed_in in m for m in messages), messages
