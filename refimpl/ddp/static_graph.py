"""``static_graph=True``: learn each parameter's gradient count once, then rely on it.

With a static graph a parameter may receive its gradient in several pieces in one backward
(reentrant activation checkpointing runs a segment's backward as its own graph task; a
parameter shared by two segments gets one hook call per segment). The first synced backward
therefore reduces nothing while it runs: it only counts hook calls per parameter (and notes
when each first arrived), and the reducer marks every parameter ready at its end. From then
on a parameter is ready at its expected count, a parameter whose expected count is 0 is
unused from the start, and a different count is an error that names the parameter.

This bookkeeping is a separate hook path (``Reducer._on_grad_static``): the dynamic-graph
hook never pays for it.
"""

from __future__ import annotations

from .unused_params import static_count_error

__all__ = ["StaticGraph"]


class StaticGraph:
    """Hook counts of the current backward against those of the first one."""

    __slots__ = ("counts", "expected", "global_used")

    def __init__(self, n: int) -> None:
        self.counts = [0] * n
        self.expected: list[int] | None = None  # learnt at the end of the first backward
        self.global_used: list[int] | None = None  # the first backward's all-reduced used map

    @property
    def learning(self) -> bool:
        """The first synced backward: count, reduce at its end."""
        return self.expected is None

    def begin(self) -> list[int]:
        """A new synced backward: reset the counts; return the parameters known unused."""
        self.counts = [0] * len(self.counts)
        if self.expected is None:
            return []
        return [i for i, c in enumerate(self.expected) if c == 0]

    def count(self, i: int, name: str) -> bool:
        """One more gradient for parameter ``i``: whether it is complete now (raise if too many)."""
        c = self.counts[i] = self.counts[i] + 1
        if self.expected is None:
            return c == 1  # learning: "complete" means "first seen" (timestamps, used map)
        expected = self.expected[i]
        if c > expected:
            raise static_count_error(name, c, expected)
        return c == expected

    def learn(self) -> list[int]:
        """End of the first backward: today's counts become the expected ones.

        Returns the parameters that got no gradient (reverse index order, as torch records
        them in its ready order).
        """
        self.expected = list(self.counts)
        return [i for i in range(len(self.expected) - 1, -1, -1) if self.expected[i] == 0]
