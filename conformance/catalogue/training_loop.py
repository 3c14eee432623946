"""DDP scenarios about the training loop around the engine, which real engines taught us.

- gradients cleared with `set_to_none=True` and `False` in turn (FairScale#354: SDP + OSS is
  silently wrong from step 2 with `set_to_none=True`, torch 2.x's default);
- the engine's own `zero_grad` instead of the optimizer's;
- runs of 10+ steps (stateful or lossy comm hooks such as PowerSGD only start after a warm-up);
- rank-skewed timing: the last rank sleeps before backward or before the step, so collectives
  arrive out of lockstep (an engine that reads a result before waiting for it is caught);
- buffers registered in a different order on each rank (huggingface/transformers#48162 class:
  a positional broadcast silently puts rank 0's values into another buffer).

Each is caught by a known-bad implementation in `conformance/mutants/training_loop.py` (or, for the
buffer order, by torch DDP itself: see its xfail list).
"""

from __future__ import annotations

from collections.abc import Callable

from conformance.catalogue.profiles import STANDARD
from conformance.spec import Capability as C
from conformance.spec import Scenario


def scenarios(m: Callable[..., Scenario]) -> list[Scenario]:
    """`m` is the DDP catalogue's scenario maker (ids, tolerances, capabilities)."""
    return [
        m("set-to-none-alternate", "mlp", steps=4, zero_grad="alternate",
          description="optimizer.zero_grad(set_to_none=True) and (False) in turn", upstream="facebookresearch/fairscale#354"),
        m("set-to-none-alternate", "buffered", steps=4, zero_grad="alternate", profiles=STANDARD),
        m("zero-grad-engine", "mlp", steps=3, zero_grad="engine", extra_requires=frozenset({C.ENGINE_ZERO_GRAD}),
          description="the engine's own zero_grad() clears gradients instead of the optimizer's"),
        # Adam: its steps are bounded by the learning rate, so 10+ steps never diverge (SGD with
        # momentum on the exact-data MLP overflows to inf by step 6, and NaN == NaN proves nothing).
        m("long", "mlp", steps=12, optimizer="adam",
          description="12 steps: past the warm-up of stateful comm hooks (PowerSGD)"),
        m("long-adam", "transformer", steps=10, optimizer="adam", profiles=STANDARD),
        m("long-no-sync", "mlp", steps=10, micro_batches=2, optimizer="adam", profiles=STANDARD),
        m("skew-backward", "mlp", steps=3, skew="backward",
          description="the last rank sleeps before backward: collectives arrive out of lockstep"),
        m("skew-step", "mlp", steps=3, skew="step",
          description="the last rank sleeps before the optimizer step: the next backward starts skewed"),
        m("skew-backward", "mlp", w=3, steps=3, skew="backward", profiles=STANDARD),
        m("buffer-order", "buffer-order", steps=3, profiles=STANDARD, upstream="huggingface/transformers#48162",
          description="two same-shape buffers registered in a different order on odd ranks"),
    ]
