"""The one place an area is registered: a module here per area, holding its `AREA` entry.

Adding an area is this package's one module plus the area's files, which the entry names: its
scenarios (`conformance/catalogue/<area>.py`), rank task and judge (`conformance/runners/`), oracle
(`conformance/oracle/<area>.py`), built-in adapters (`conformance/adapters/`), zoos
(`conformance/mutants/<area>.py`, `conformance/mutants/independent/<area>.py`), its suite module
(`conformance/suite/test_<area>.py`) and contract (`docs/contracts/<area>.md`). Nothing else
lists the areas: the vocabulary's names (`conformance.spec.AREA_NAMES`), the catalogue
(`conformance.catalogue.SCENARIOS`), the area registry (`conformance.area.AREAS`), the zoos and
the built-in adapters are all read from `ENTRIES`.

The entries are found by listing this package (each module imports only `entry`), in each
entry's `order`.
"""

from __future__ import annotations

import importlib
import pkgutil

from conformance.areas.entry import AreaEntry


def _entries() -> tuple[AreaEntry, ...]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name != "entry":
            entry = importlib.import_module(f"{__name__}.{info.name}").AREA
            if entry.name != info.name:
                raise RuntimeError(f"conformance/areas/{info.name}.py registers an area named {entry.name!r}")
            found.append(entry)
    return tuple(sorted(found, key=lambda e: e.order))


ENTRIES: tuple[AreaEntry, ...] = _entries()
NAMES: tuple[str, ...] = tuple(e.name for e in ENTRIES)
BY_NAME: dict[str, AreaEntry] = {e.name: e for e in ENTRIES}


def resolve(ref: str):
    """The object a `module:attribute` reference names (a module for a plain `module`)."""
    module, _, attribute = ref.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attribute) if attribute else found
