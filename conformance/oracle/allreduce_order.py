"""A backend's all-reduce summation order, discovered by probing it, and replayed bitwise.

A sum of three or more floats depends on the order it is added in, and a lossy, nonlinear
consumer of that sum (PowerSGD orthogonalizes P after summing it) carries the last-bit
difference into everything after it: no envelope of orders survives the orthogonalization.
What does survive is knowing the order. gloo's CPU all-reduce adds the ranks' values in an
order fixed by the world size, the tensor's length and dtype, and the element's index (ring
segments), not by the data; so the order is discovered, on the engine's own process group,
with crafted probes, and the oracle replays exactly that order.

The probe. Every all-reduce the backend computes is taken to be a binary tree of pairwise
additions over the ranks' values (`a + b` is exact-commutative in IEEE arithmetic, so only the
tree's shape and the leaves' places matter). A rooted binary tree is fixed by its triplets:
for each three ranks {i, j, k}, which two are added together first. One probe all-reduce per
(triple, odd one out k) answers that for every element at once: rank i sends +L, rank j sends
-L, rank k sends 1, every other rank 0, where L = 8/eps of the dtype (adding 1 to ±L rounds it
away). The sum is exactly 1 where i and j were joined before k meets them, exactly 0 otherwise
(0 added anywhere is exact). Of the three probes of a triple exactly one must read 1; anything
else (no pair, two pairs, any other value) means the sum is not such a tree and discovery
fails loudly. Every probe runs twice: a different answer means the order depends on timing,
and discovery fails (the caller says what it cannot judge; no norm bound stands in).

The replay (`Orders.sum`) groups elements by their tree and adds the ranks' tensors along it,
element by element in the tensor's dtype: bitwise the backend's result where the model holds.
tests/conformance/test_allreduce_order.py checks that on random data at 3 and 4 ranks over
many lengths against real gloo all-reduces, and that rank order alone would not be bitwise.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

Tree = int | tuple  # a leaf (a rank) or a pair of subtrees


class OrderUnknown(RuntimeError):
    """The probes do not show one fixed binary-tree order per element."""


def triples(world_size: int) -> list[tuple[int, int, int]]:
    return list(itertools.combinations(range(world_size), 3))


def _big(dtype: torch.dtype) -> float:
    return 8.0 / torch.finfo(dtype).eps  # spacing 4 below L, 8 above: L + 1 and -L + 1 round back to ±L


def probe_values(rank: int, world_size: int, numel: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> list[Tensor]:
    """This rank's tensors, one per probe all-reduce (three per triple: k = the odd one out),
    on ``device`` (the rank's: NCCL takes only its GPU's tensors)."""
    big, out = _big(dtype), []
    for triple in triples(world_size):
        for k in triple:
            i, j = (r for r in triple if r != k)
            value = big if rank == i else -big if rank == j else 1.0 if rank == k else 0.0
            out.append(torch.full((numel,), value, dtype=dtype, device=device))
    return out


def probe(group, world_size: int, rank: int, sizes, repeats: int = 2, device: torch.device | str = "cpu") -> dict:
    """Run on every rank of `group`, with the same `sizes` ((numel, dtype name) pairs) everywhere,
    all-reducing on `device` (the rank's): the raw probe results, on the CPU,
    `{(numel, dtype): Tensor[repeats, probes, numel]}`, for `discover`."""
    import torch.distributed as dist

    out = {}
    for numel, dtype_name in sorted(set(sizes)):
        dtype = getattr(torch, dtype_name)
        runs = []
        for _ in range(repeats):
            tensors = probe_values(rank, world_size, numel, dtype, device)
            for t in tensors:
                dist.all_reduce(t, group=group)
            runs.append(torch.stack(tensors).cpu() if tensors else torch.empty(0, numel, dtype=dtype))
        out[(numel, dtype_name)] = torch.stack(runs)
    return out


def _build(leaves: list[int], first: dict) -> Tree:
    """The tree from its triplets (Aho et al.'s BUILD): ranks joined before any third split last."""
    if len(leaves) == 1:
        return leaves[0]
    if len(leaves) == 2:
        return (leaves[0], leaves[1])
    parent = {r: r for r in leaves}

    def find(r):
        while parent[r] != r:
            r = parent[r]
        return r

    for i, j in itertools.combinations(leaves, 2):
        if any(first[tuple(sorted((i, j, k)))] == (min(i, j), max(i, j)) for k in leaves if k not in (i, j)):
            parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for r in leaves:
        groups.setdefault(find(r), []).append(r)
    if len(groups) != 2:
        raise OrderUnknown(f"ranks {leaves} do not split into two subtrees ({len(groups)} groups)")
    a, b = groups.values()
    return (_build(a, first), _build(b, first))


@dataclass
class Orders:
    """Per element, the tree the backend adds the ranks' values along (one length and dtype)."""

    world_size: int
    trees: list[tuple[Tree, Tensor]]  # (tree, element indices)

    def sum(self, tensors: list[Tensor]) -> Tensor:
        """The all-reduce of `tensors` (one per rank, in rank order) as the backend adds them."""
        if len(tensors) != self.world_size:
            raise ValueError(f"{len(tensors)} tensors for a {self.world_size}-rank order")
        if self.world_size <= 2:
            return tensors[0] + tensors[1] if self.world_size == 2 else tensors[0].clone()
        flat = [t.reshape(-1) for t in tensors]
        out = torch.empty_like(flat[0])
        for tree, index in self.trees:
            out[index] = _evaluate(tree, [t[index] for t in flat])
        return out.view_as(tensors[0])

    def describe(self) -> str:
        return "; ".join(f"{_render(tree)} on {index.numel()} elements" for tree, index in self.trees)


def _evaluate(tree: Tree, values: list[Tensor]) -> Tensor:
    if isinstance(tree, int):
        return values[tree]
    return _evaluate(tree[0], values) + _evaluate(tree[1], values)


def _render(tree: Tree) -> str:
    return str(tree) if isinstance(tree, int) else f"({_render(tree[0])}+{_render(tree[1])})"


def discover(world_size: int, numel: int, results: Tensor) -> Orders:
    """The per-element trees from `probe`'s results for one length (raises `OrderUnknown`)."""
    if world_size <= 2:
        return Orders(world_size, [])
    runs = results.to(torch.float64)
    if not all(torch.equal(runs[0], r) for r in runs[1:]):
        raise OrderUnknown(f"the all-reduce of {numel} elements summed in different orders on repeated probes")
    reads = runs[0]
    if not bool(((reads == 0) | (reads == 1)).all()):
        raise OrderUnknown(f"a probe all-reduce of {numel} elements returned a value other than 0 or 1: "
                           "the backend does not add the ranks' values pairwise")
    ts = triples(world_size)
    per_triple = reads.view(len(ts), 3, numel)
    if not bool((per_triple.sum(1) == 1).all()):
        raise OrderUnknown(f"for an all-reduce of {numel} elements a triple of ranks has no single pair added first")
    odd = per_triple.argmax(1).T  # [numel, triples]: which member was the odd one out where i, j met first
    codes, inverse = torch.unique(odd, dim=0, return_inverse=True)
    trees = []
    for c, code in enumerate(codes.tolist()):
        first = {t: tuple(r for r in t if r != t[k]) for t, k in zip(ts, code, strict=True)}
        tree = _build(list(range(world_size)), first)
        trees.append((tree, (inverse == c).nonzero().flatten()))
    return Orders(world_size, trees)


def discover_all(world_size: int, probed: dict | None) -> dict[tuple[int, str], Orders]:
    """`discover` for every probed length: `{(numel, dtype name): Orders}`."""
    return {key: discover(world_size, key[0], results) for key, results in (probed or {}).items()}
