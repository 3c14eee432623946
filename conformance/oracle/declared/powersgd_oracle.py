"""The PowerSGD oracle: torch's `powerSGD_hook` simulated over the ranks' gradients, in one process.

PowerSGD is lossy, so "close to the plain average" proves little (a hook that returns zeros is
within 100% of any gradient). Instead the oracle runs the algorithm itself, on every rank's own
gradient, with the state torch keeps (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py),
and the engine must reproduce it:

- the hook sees DDP's buckets: one flat buffer per bucket, in DDP's layout. Before the rebuild
  (iteration 0; with static_graph iterations 0 and 1) that is one bucket of every parameter in
  registration order (no find_unused_parameters) or `_compute_bucket_assignment_by_size` over the
  parameters, reversed; after the rebuild (unless find_unused_parameters without static_graph)
  the same function over the order the gradients became ready in rank 0's first backward (its
  own model, under the scenario's autocast). PowerSGD's state is
  keyed by bucket index; compression starts at `start_powerSGD_iter` >= 2, after the rebuild.
- warm-up (`state.iter < start_powerSGD_iter`): each rank divides its buffer by W, then sum.
- compressed steps, per bucket in index order: error feedback added to the rank's buffer (a zero
  buffer the first time) and a copy kept; each parameter's gradient viewed as
  `(shape[0], -1)`, compressed when `(n + m) * r * min_compression_rate < n * m`, the rest
  summed and divided by W; Ps and Qs laid out grouped by shape (first-seen order); Q drawn once
  (warm start) from `torch.manual_seed(numpy.RandomState(random_seed).randint(1e9))`, one
  `randn` per Q in layout order, each orthogonalized; later steps re-orthogonalize the previous
  averaged Q. P = M Q per rank, summed, orthogonalized (Gram-Schmidt for rank <= 2 or half
  precision, `linalg.qr` otherwise); Q = M^T P per rank, summed, divided by W; M = P Q^T; the
  rank's error becomes its copy minus the result.
- `batched_powerSGD_hook`: the whole bucket as one zero-padded square matrix.
- `fp16_compress_wrapper` / `bf16_compress_wrapper`: the bucket cast to the half dtype first;
  everything above runs in it (the error buffers too) and the result is cast back.

The same kernels on the same shapes run here as on each rank, and every all-reduce (the warm-up
buckets, P, Q, the uncompressed part) is added in the backend's own order: a sum of two terms has
one order, and at 3+ ranks the order each element is summed in is the one discovered on the
engine's own process group (`conformance.oracle.allreduce_order`: crafted probe all-reduces of every
length the hook reduces, run by the ranks after training and recorded). No envelope of orders
survives the orthogonalization, but a known order needs none: the result is bitwise torch's at
2, 3 and 4 ranks (tests/conformance/test_powersgd_oracle.py: every step of powerSGD_hook,
fp16_compress_wrapper, batched same-shape tensors, rank 2 without warm start, and three broken
hooks). Without a recorded probe at 3+ ranks the simulation refuses to judge (no rank-order guess).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from conformance.oracle.declared.ddp_buckets import bucket_layout, ready_order

HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PowerSGDConfig:
    """`PowerSGDState`'s arguments (torch's defaults) and which hook/wrapper the engine registers."""

    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1_000
    min_compression_rate: float = 2
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0
    random_seed: int = 0
    batch_tensors_with_same_shape: bool = False
    batched_hook: bool = False  # batched_powerSGD_hook instead of powerSGD_hook
    compress: str = ""  # "" | "float16" | "bfloat16": fp16_/bf16_compress_wrapper around the hook

    def describe(self) -> str:
        hook = "batched_powerSGD_hook" if self.batched_hook else "powerSGD_hook"
        if self.compress:
            hook = f"{self.compress[:4]}_compress_wrapper({hook})"
        return (f"{hook} simulated (rank {self.matrix_approximation_rank}, start_powerSGD_iter "
                f"{self.start_powerSGD_iter}, error feedback {self.use_error_feedback}, warm start {self.warm_start}, "
                f"min_compression_rate {self.min_compression_rate}, seed {self.random_seed})")

    def simulator(self, scenario, named, probed: dict | None = None) -> PowerSGDSimulator:
        """`probed`: the ranks' probe all-reduces (`conformance.oracle.allreduce_order.probe`), needed at 3+ ranks."""
        return PowerSGDSimulator(self, scenario, named, probed)

    def rule(self):
        """How the engine is judged against the simulation: bitwise (the backend's order is replayed)."""
        from conformance.spec import Tolerance

        return Tolerance(True, reason="PowerSGD simulated with every all-reduce in the backend's summation order "
                                      "(order-free at 2 ranks, probed on the engine's process group beyond)")

    def allreduce_sizes(self, buckets: list[list[tuple[int, ...]]], dtype: torch.dtype) -> set[tuple[int, str]]:
        """(length, dtype name) of every all-reduce the hook issues for buckets of these parameter
        shapes: the whole bucket (warm-up), and once compressing P, Q and the uncompressed part."""
        dtype = HALF.get(self.compress, dtype)
        name = str(dtype).removeprefix("torch.")
        out = set()
        for shapes in buckets:
            numel = sum(math.prod(shape) for shape in shapes)
            out.add((numel, name))
            if self.batched_hook:
                out.add((math.ceil(math.sqrt(numel)) * self.matrix_approximation_rank, name))
                continue
            _, plain, p_size, q_size = _split(self, [torch.Size(shape) for shape in shapes])
            out |= {(sum(math.prod(shapes[i]) for i in plain), name), (p_size, name), (q_size, name)}
        return {(n, name) for n, name in out if n > 0}


def _split(cfg: PowerSGDConfig, shapes: list[torch.Size]) -> tuple[list[int], list[int], int, int]:
    """torch's `_should_compress` over a bucket: (compressed, uncompressed, P length, Q length)."""
    compress, plain = [], []
    p_size = q_size = 0
    for i, shape in enumerate(shapes):
        rows, cols = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
        rank = min(rows, cols, cfg.matrix_approximation_rank)
        if (rows + cols) * rank * cfg.min_compression_rate < rows * cols:
            compress.append(i)
            p_size += rows * rank
            q_size += cols * rank
        else:
            plain.append(i)
    return compress, plain, p_size, q_size


def _orthogonalize(matrices: Tensor, epsilon: float = 0) -> None:
    """torch's choice: Gram-Schmidt for rank <= 2 or half precision, QR otherwise (in place)."""
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            col = matrices[:, :, i:i + 1]
            col /= torch.norm(col, dim=1, keepdim=True) + (epsilon if epsilon else 0)
            if i + 1 < rank:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        torch.linalg.qr(matrices, out=(matrices, torch.empty(matrices.shape[0], rank, rank, dtype=matrices.dtype)))


class PowerSGDSimulator:
    """One PowerSGDState per rank (error buffers per rank; P/Q memory and rng are the same on
    every rank after each all-reduce, so they are kept once)."""

    def __init__(self, cfg: PowerSGDConfig, scenario, named: list[tuple[str, Tensor]], probed: dict | None = None):
        import numpy as np

        from conformance.oracle.allreduce_order import discover_all

        self.cfg, self.W = cfg, scenario.world_size
        if self.W > 2 and not probed:
            raise ValueError(f"{scenario.id}: at {self.W} ranks the PowerSGD simulation needs the backend's summation "
                             "order, probed by the ranks (Wrapped.allreduce_probe); the record has none")
        self.orders = discover_all(self.W, probed)
        self.shapes = {n: p.shape for n, p in named}
        self.buckets = bucket_layout(scenario, named, ready_order(scenario))
        self.initial = bucket_layout(scenario, named, [], initial=True)  # before the rebuild (warm-up only)
        # The reducer rebuilds its buckets at the forward after the first backward; with static_graph
        # one iteration later (torch DDP: iterations 0 and 1 reduce the initial bucket).
        self.rebuild_at = 2 if scenario.options.static_graph else 1
        self.rng = np.random.RandomState(cfg.random_seed)
        self.iter = 0
        self.errors: list[dict[int, Tensor]] = [{} for _ in range(self.W)]
        self.p_memory: dict[int, Tensor] = {}
        self.q_memory: dict[int, Tensor] = {}

    def _sum(self, tensors: list[Tensor]) -> Tensor:
        """The all-reduce of the ranks' tensors (rank order) in the backend's order for this length."""
        if self.W <= 2:
            return tensors[0] + tensors[1] if self.W == 2 else tensors[0].clone()
        key = (tensors[0].numel(), str(tensors[0].dtype).removeprefix("torch."))
        if key not in self.orders:
            raise ValueError(f"no probed summation order for an all-reduce of {key[0]} {key[1]} elements at "
                             f"{self.W} ranks (probed: {sorted(self.orders)})")
        return self.orders[key].sum(tensors)

    def reduce(self, local: list[dict[str, Tensor | None]]) -> dict[str, Tensor | None]:
        """The gradients every rank holds after this synced backward (None: used by no rank)."""
        out: dict[str, Tensor | None] = {}
        compressing = self.iter >= self.cfg.start_powerSGD_iter
        for index, names in enumerate(self.initial if self.iter < self.rebuild_at else self.buckets):
            flats = []
            for r in range(self.W):
                parts = [local[r][n] if local[r][n] is not None else torch.zeros(self.shapes[n]) for n in names]
                flat = torch.cat([t.reshape(-1) for t in parts])
                flats.append(flat.to(HALF[self.cfg.compress]) if self.cfg.compress else flat)
            if not compressing:
                result = self._sum([f.div_(self.W) for f in flats])
            elif self.cfg.batched_hook:
                result = self._batched(index, flats)
            else:
                result = self._layerwise(index, names, flats)
            dtype = next(t.dtype for t in (local[0][n] for n in names) if t is not None) if any(
                local[0][n] is not None for n in names) else torch.float32
            result = result.to(dtype)
            offset = 0
            for n in names:
                numel = math.prod(self.shapes[n])
                used = any(local[r][n] is not None for r in range(self.W))
                out[n] = result[offset:offset + numel].view(self.shapes[n]).clone() if used else None
                offset += numel
        self.iter += 1
        return out

    def _with_error(self, index: int, flats: list[Tensor]) -> list[Tensor | None]:
        copies: list[Tensor | None] = [None] * self.W
        if self.cfg.use_error_feedback:
            for r, flat in enumerate(flats):
                if index in self.errors[r]:
                    flat.add_(self.errors[r][index])
                else:
                    self.errors[r][index] = torch.zeros_like(flat)
                copies[r] = flat.detach().clone()
        return copies

    def _random_q(self, shape, dtype) -> Tensor:
        return torch.randn(*shape, device="cpu", dtype=dtype)

    def _layerwise(self, index: int, names: list[str], flats: list[Tensor]) -> Tensor:
        """torch's `powerSGD_hook` on one bucket, in its phases: the uncompressed part averaged;
        the matrices batched by shape; Q started (random, or warm); P = M Q summed and
        orthogonalized; Q = M^T P averaged; M = P Q^T written back; the error kept."""
        cfg, W = self.cfg, self.W
        dtype = flats[0].dtype
        copies = self._with_error(index, flats)
        views = [self._views(names, flat) for flat in flats]  # per rank: the per-parameter views of its buffer
        compress, plain, p_size, q_size = _split(cfg, [self.shapes[n] for n in names])
        if plain:
            self._average_uncompressed(views, plain)
        randomize = not cfg.warm_start or index not in self.p_memory
        if randomize:
            self.p_memory[index] = torch.empty(p_size, dtype=dtype)
            self.q_memory[index] = torch.empty(q_size, dtype=dtype)
        batches = self._batches(names, views, compress)
        self._start_q(index, batches, randomize, dtype)
        mats = [_matrices(views[r], batches) for r in range(W)]
        ps = self._compute_p(index, batches, mats)
        qs = self._compute_q(index, batches, mats, ps)
        for r in range(W):  # M = P Q^T, into every rank's buffer
            for (members, _, _, _), tensor, p, q in zip(batches, mats[r], ps, qs, strict=True):
                torch.bmm(p, q.transpose(1, 2), out=tensor)
                if len(members) > 1:  # stacked copies: back into the bucket's views
                    for k, i in enumerate(members):
                        views[r][i].view_as(tensor[k]).copy_(tensor[k])
        for r in range(W):
            if cfg.use_error_feedback:
                self.errors[r][index] = copies[r] - flats[r]
        if not cfg.warm_start:
            self.p_memory.clear()
            self.q_memory.clear()
        return flats[0]

    def _views(self, names: list[str], flat: Tensor) -> list[Tensor]:
        offset, mine = 0, []
        for n in names:
            numel = math.prod(self.shapes[n])
            mine.append(flat[offset:offset + numel].view(self.shapes[n]))
            offset += numel
        return mine

    def _average_uncompressed(self, views: list[list[Tensor]], plain: list[int]) -> None:
        """The uncompressed part: summed, then divided by W."""
        W = self.W
        summed = self._sum([torch.cat([views[r][i].reshape(-1) for i in plain]) for r in range(W)]).div_(W)
        for r in range(W):
            offset = 0
            for i in plain:
                numel = views[r][i].numel()
                views[r][i].copy_(summed[offset:offset + numel].view_as(views[r][i]))
                offset += numel

    def _batches(self, names: list[str], views: list[list[Tensor]], compress: list[int]) -> list[tuple]:
        """(member indices, n, m, rank) per batch: layout grouped by shape, first-seen order
        (torch's shape_to_tensors dict)."""
        cfg = self.cfg
        groups: dict[torch.Size, list[int]] = defaultdict(list)
        for i in compress:
            rows = self.shapes[names[i]][0]
            groups[torch.Size((rows, views[0][i].numel() // rows))].append(i)
        batches = []
        for shape, members in groups.items():
            rows, cols = shape
            rank = min(rows, cols, cfg.matrix_approximation_rank)
            if cfg.batch_tensors_with_same_shape:
                batches.append((members, rows, cols, rank))
            else:
                batches.extend(([i], rows, cols, rank) for i in members)
        return batches

    def _start_q(self, index: int, batches: list[tuple], randomize: bool, dtype) -> None:
        """Q, orthogonalized: drawn from the hook's seeded generator, or the last step's (warm start)."""
        cfg = self.cfg
        qs = _carve(self.q_memory[index], batches, "q")
        if not randomize:
            for q in qs:
                _orthogonalize(q, cfg.orthogonalization_epsilon)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.rng.randint(1_000_000_000))
                for q in qs:
                    q.copy_(self._random_q(q.shape, dtype))
                    _orthogonalize(q, cfg.orthogonalization_epsilon)

    def _compute_p(self, index: int, batches: list[tuple], mats: list[list[Tensor]]) -> list[Tensor]:
        """P = M Q on every rank, summed across ranks (the first all-reduce), orthogonalized."""
        qs = _carve(self.q_memory[index], batches, "q")
        p_rank = []
        for r in range(self.W):
            memory = torch.empty_like(self.p_memory[index])
            for tensor, q, p in zip(mats[r], qs, _carve(memory, batches, "p"), strict=True):
                torch.bmm(tensor, q, out=p)
            p_rank.append(memory)
        self.p_memory[index] = self._sum(p_rank)
        ps = _carve(self.p_memory[index], batches, "p")
        for p in ps:
            _orthogonalize(p, self.cfg.orthogonalization_epsilon)
        return ps

    def _compute_q(self, index: int, batches: list[tuple], mats: list[list[Tensor]], ps: list[Tensor]) -> list[Tensor]:
        """Q = M^T P on every rank, averaged across ranks (the second all-reduce)."""
        W = self.W
        q_rank = []
        for r in range(W):
            memory = torch.empty_like(self.q_memory[index])
            for tensor, p, q in zip(mats[r], ps, _carve(memory, batches, "q"), strict=True):
                torch.bmm(tensor.transpose(1, 2), p, out=q)
            q_rank.append(memory)
        self.q_memory[index] = self._sum(q_rank).div_(W)
        return _carve(self.q_memory[index], batches, "q")

    def _batched(self, index: int, flats: list[Tensor]) -> Tensor:
        cfg, W = self.cfg, self.W
        length = flats[0].numel()
        side = math.ceil(math.sqrt(length))
        padded = []
        for flat in flats:
            grown = torch.zeros(side * side, dtype=flat.dtype)
            grown[:length] = flat
            padded.append(grown)
        copies = self._with_error(index, padded)
        mats = [f.view(side, side) for f in padded]
        dtype = padded[0].dtype
        if not cfg.warm_start or index not in self.p_memory:
            self.p_memory[index] = torch.empty(side, cfg.matrix_approximation_rank, dtype=dtype)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.rng.randint(1_000_000_000))
                self.q_memory[index] = self._random_q((side, cfg.matrix_approximation_rank), dtype)
        q = self.q_memory[index]
        _orthogonalize(q.unsqueeze(0))  # torch passes the 2-D Q: see the xfail for this hook
        p = self._sum([torch.matmul(m, q) for m in mats])
        _orthogonalize(p.unsqueeze(0))
        q = self._sum([torch.matmul(m.t(), p) for m in mats]).div_(W)
        self.p_memory[index], self.q_memory[index] = p, q
        for r in range(W):
            torch.matmul(p, q.t(), out=mats[r])
            if cfg.use_error_feedback:
                self.errors[r][index] = copies[r] - padded[r]
        if not cfg.warm_start:
            self.p_memory.clear()
            self.q_memory.clear()
        return padded[0][:length]


def _matrices(views: list[Tensor], batches: list[tuple]) -> list[Tensor]:
    """One rank's matrices per batch: a (1, n, m) view, or the members stacked (a copy)."""
    out = []
    for members, rows, cols, _ in batches:
        mats = [views[i].view(rows, cols) for i in members]
        out.append(mats[0].unsqueeze(0) if len(mats) == 1 else torch.stack(mats))
    return out


def _carve(memory: Tensor, batches: list[tuple], which: str) -> list[Tensor]:
    """The P (or Q) memory of a bucket, as one (members, n (or m), rank) view per batch."""
    out, idx = [], 0
    for members, rows, cols, rank in batches:
        length = len(members) * (rows if which == "p" else cols) * rank
        out.append(memory[idx:idx + length].view(len(members), rows if which == "p" else cols, rank))
        idx += length
    return out
