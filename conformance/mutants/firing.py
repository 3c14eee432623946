"""Did the bug fire: the one counter every known-bad implementation keeps.

A mutant is a correct implementation with one bug, and a scenario that fails against it proves
something only if the bug took effect in that very case: a failure for another reason would be
a false catch. So each mutant calls `self._fired(...)` exactly where its bug *changed* what the
correct code would have done (a division that mattered, a bucket skipped that existed, a cast
that rounded a value), and `gradparity zoo` counts a catch only where `mutation_fired > 0`
(`conformance.frontends.zoo`). Its records carry the count: the mutant's `backward_stats()`
(DDP, sharded), the rank's record (bucketer), or every worker's, summed (dist_autograd).

Usage::

    class SkipsUnused(Fires, Correct):
        def _finalize(self):
            unused = [p for p in self._params if p.grad is None]
            self._fired(bool(unused))          # once, only if there was something to skip
            ...
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()  # autograd and RPC threads may count at once


class Fires:
    """Mixin: `mutation_fired`, how often this object's bug changed what the correct code does."""

    mutation_fired: int = 0

    def _fired(self, n: int | bool = 1) -> None:
        """The bug took effect `n` times; given a condition instead (a bool, or anything that
        tests true or false), once if it holds."""
        count = n if isinstance(n, int) else int(bool(n))
        if count:
            with _LOCK:
                self.mutation_fired += count
