"""What the independent-zoo tests compare: a rank's probe results, equal to the last bit."""

from __future__ import annotations

import torch


def same(a, b) -> bool:
    """Nested dicts of tensors (or plain values) equal in keys, dtypes and every bit."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def run_probes(probes: dict, correct_for, mutants, rank: int) -> dict:
    """One rank's results: every probe on its correct engine (`correct_for(name)`), then each
    mutant on its own probe (the interaction zoos' worlds)."""
    out = {"correct": {name: probe(correct_for(name), rank) for name, probe in probes.items()}}
    out.update({name: probe(mutants[name](), rank) for name, probe in probes.items()})
    return out


def assert_fires_and_differs(world: list, name: str) -> None:
    """Mutant `name` fired on some rank, and some rank's values differ from the correct engine's."""
    assert sum(ranks[name]["fired"] for ranks in world) > 0, f"{name} did not fire"

    def values(result: dict) -> dict:
        return {k: v for k, v in result.items() if k != "fired"}

    assert not all(same(values(ranks[name]), values(ranks["correct"][name])) for ranks in world), \
        f"{name}: the same values as the correct engine"
