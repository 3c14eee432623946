"""Each rank's random-number stream, as the oracle replays it (dropout in forward).

[Note: replayed randomness]
A rank draws its dropout masks from torch's default generator, seeded by the rank loop
(`conformance.models.rng.seed_of`) and advanced by every forward. The rank records the state
it had before each forward; the oracle replays that rank's forward from the recorded state, so
its masks are the rank's own, bit for bit (re-anchored, like the parameters: `Anchor`).

What the oracle adds: where the stream *should* be. Rank r's stream starts at the seed and
each forward leaves it where the next one must begin; a recorded state elsewhere means the
engine drew random numbers between forwards (at construction, in a hook, in a collective), so
every mask differs from what one process draws from the same seed. That is a failure with
its own cause (`rng.describe_break`), reported at the first forward that draws from the moved
stream; a model whose forward draws nothing is never judged on it (the position is invisible).
Without a recorded state (straight-through oracle, runs that record none) the oracle replays
from where it expects the stream.
"""

from __future__ import annotations

import contextlib

from conformance.models import rng


class Streams:
    def __init__(self, scenario, anchor=None):
        self.device = scenario.device
        self.expected = [rng.start(scenario.seed, r, scenario.device) for r in range(scenario.world_size)]
        self.anchor = anchor
        self.broken: tuple[int, int, int, str] | None = None  # (rank, step, micro, cause): the first break

    @contextlib.contextmanager
    def forward(self, rank: int, step: int, micro: int):
        """Run one replayed forward of `rank` from its stream; note a break the engine made."""
        recorded = self.anchor.rng_before(rank, step, micro) if self.anchor is not None else None
        start = recorded if recorded is not None else self.expected[rank]
        rng.restore(start, self.device)
        yield
        after = rng.capture(self.device)
        drew = not rng.same(start, after)
        if self.broken is None and drew and recorded is not None and not rng.same(recorded, self.expected[rank]):
            self.broken = (rank, step, micro, rng.describe_break(rank, step, micro))
        self.expected[rank] = after


@contextlib.contextmanager
def isolated(device):
    """The oracle seeds and restores torch's generator: the caller's stream is left as it was."""
    import torch

    cuda = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        yield
