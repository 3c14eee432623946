"""The engine's own state at every step boundary, read from the ranks' records: the re-anchor.

[Note: re-anchored steps]
The oracle used to train its own copy straight through: after a few steps its parameters had
drifted from a correct engine's by every step's last-bit differences (another summation order
at 3-4 ranks, a bf16 rounding flipped by that), so each step needed a band wide enough for the
drift. Re-anchored, the oracle starts every step from the engine's state and judges only that
step:

- parameters: the anchor rank's recorded parameters after the previous step (step 0: the
  oracle's own, which the construction check has already held the engine to, bitwise);
- buffers: every rank's recorded buffers after the previous step (the buffer rule then says
  which of them each rank forwards from);
- optimizer and GradScaler state: the oracle's own optimizer and scaler stepped on the
  engine's *verified* gradients from the engine's parameters, i.e. exactly the state a correct
  engine holds. Taking the engine's optimizer state instead would adopt a corrupted state
  unjudged; an engine whose optimizer state goes wrong shows it in the next step's parameters;
- the optimizer step itself: applied to the engine's synced gradient (already judged), so the
  expected parameters are bitwise what the same optimizer computes.

The anchor rank is the first rank taking part at that point (rank 0 unless it ran out of data
under join). Where the record stops (a rank raised), the oracle continues from its own state.
Records are only read: every tensor is cloned before the oracle uses it.
"""

from __future__ import annotations

from torch import Tensor


class Anchor:
    """Index of the ranks' records by step: parameters, buffers and synced gradients."""

    def __init__(self, records: dict[int, dict], world_size: int):
        self.world_size = world_size
        self._params: dict[int, dict[str, Tensor]] = {}  # step -> params after it (anchor rank)
        self._buffers: dict[int, list[dict[str, Tensor] | None]] = {}  # step -> per-rank buffers after it
        self._grads: dict[int, dict[str, Tensor | None]] = {}  # step -> synced grads (anchor rank)
        self._rng: dict[tuple[int, int, int], dict] = {}  # (rank, step, micro) -> RNG state before that forward
        for rank in range(world_size):
            record = records.get(rank) or {}
            for event in record.get("events") or []:
                step, values = event.get("step"), event.get("values")
                if event.get("kind") == "step":
                    if values is not None and step not in self._params:
                        self._params[step] = values
                    self._buffers.setdefault(step, [None] * world_size)[rank] = event.get("buffers")
                elif event.get("kind") == "backward" and event.get("synced") and values is not None:
                    self._grads.setdefault(step, values)
                if event.get("kind") == "backward" and event.get("rng") is not None:
                    self._rng[(rank, step, event.get("micro", 0))] = event["rng"]
        # The backend's all-reduce order, probed by the ranks (Wrapped.allreduce_probe; the same on every rank).
        self.allreduce_probe = (records.get(0) or {}).get("allreduce_probe")

    def params_before(self, step: int) -> dict[str, Tensor] | None:
        """The parameters the engine holds entering `step` (None at step 0 or past the record)."""
        return self._params.get(step - 1) if step > 0 else None

    def buffers_before(self, step: int) -> list[dict[str, Tensor] | None] | None:
        """Every rank's buffers entering `step` (None where unknown)."""
        per_rank = self._buffers.get(step - 1) if step > 0 else None
        return per_rank if per_rank is not None and all(b is not None for b in per_rank) else None

    def rng_before(self, rank: int, step: int, micro: int) -> dict | None:
        """The RNG state rank `rank` had before the forward of (step, micro) (oracle.streams)."""
        return self._rng.get((rank, step, micro))

    def grads(self, step: int) -> dict[str, Tensor | None] | None:
        """The engine's synced gradients of `step` (what its optimizer stepped on)."""
        return self._grads.get(step)


def load_params(model, values: dict[str, Tensor]) -> None:
    """Copy the engine's parameters into the oracle's model (same names, any device)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in values and values[name] is not None:
                p.copy_(values[name].to(p.device))
