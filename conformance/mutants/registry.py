"""How an area's zoo module registers its mutants: one table, one decorator, one factory per name.

Every area module (`bucketer.py`, `data_parallel.py`, `dist_autograd.py`, `sharded.py`) keeps
its mutants in a `Registry`: a decorator names each mutant's bug and the contract clause it
breaks, and `factories()` gives the module one adapter factory per mutant, so a mutant loads
the way a third-party adapter does (`--adapter conformance.mutants.<area>:<name with - as _>`,
see `conformance.mutants.area_zoo`). The bug itself stays in the mutant's own class.

Usage::

    MUTANTS = Registry("zoo-dp")

    @MUTANTS.mutant("gathers-reversed", "D1", "replica outputs are concatenated in reverse order")
    class GathersReversed(Correct): ...

    globals().update(MUTANTS.factories())   # conformance.mutants.data_parallel:gathers_reversed
"""

from __future__ import annotations

from collections.abc import Callable


class Registry(dict):
    """Mutant name -> the adapter class that implements it (one area)."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix  # adapter names are f"{prefix}-{mutant name}"

    def mutant(self, name: str, clause: str, bug: str, *, may_abort: bool = False,
               adapter: Callable[[object], type] | None = None):
        """Register the decorated object as mutant `name`; the object is returned unchanged.

        `adapter(obj)` builds the area's adapter class around it where the decorated object is
        not an adapter itself (a bucketer delegate, an engine factory); default: the object.
        """
        def register(obj):
            cls = adapter(obj) if adapter is not None else obj
            cls.name, cls.bug, cls.clause, cls.may_abort = f"{self.prefix}-{name}", bug, clause, may_abort
            self[name] = cls
            return obj
        return register

    def interaction(self, name: str, clause: str, pair: str, bug: str, **kw):
        """An interaction mutant (issue 38): `pair` names the two things that must meet for its
        bug to show; it leads the bug's line and is kept on the adapter class (`cls.pair`)."""
        register = self.mutant(name, clause, f"[{pair}] {bug}", **kw)

        def with_pair(obj):
            register(obj)
            self[name].pair = pair
            return obj
        return with_pair

    def factories(self) -> dict[str, Callable[[], object]]:
        """`name_with_underscores -> factory` for each mutant (a module's globals take them)."""
        return {name.replace("-", "_"): _factory(cls) for name, cls in self.items()}


def _factory(cls: type) -> Callable[[], object]:
    return lambda: cls()
