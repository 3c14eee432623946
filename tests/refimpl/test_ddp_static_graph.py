"""refimpl/ddp/static_graph.py: the first backward's hook counts become the expected ones."""

from __future__ import annotations

import pytest

from refimpl.ddp.static_graph import StaticGraph


def test_static_graph_learns_counts_then_checks_them():
    graph = StaticGraph(3)
    assert graph.learning and graph.begin() == []
    assert graph.count(0, "a") is True and graph.count(0, "a") is False  # learning: first arrival
    assert graph.count(1, "b") is True
    assert graph.learn() == [2]  # got no gradient
    assert not graph.learning and graph.expected == [2, 1, 0]
    assert graph.begin() == [2]  # unused from the start
    assert graph.count(0, "a") is False and graph.count(0, "a") is True  # ready at the learnt count
    with pytest.raises(RuntimeError, match="'a' received 3 gradients"):
        graph.count(0, "a")
