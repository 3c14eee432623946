"""The `dist_autograd` area's oracle: plain local autograd over the same composition.

Every composition (`conformance.models.dist_autograd.COMPOSITIONS`) also runs in mode "local":
each remote call is a plain Python call in this process, so `torch.autograd.grad` over its roots
gives the gradient every distributed-autograd context must hold, by leaf and by owning worker. A
generated row (`conformance.models.dist_autograd_composed`) is replayed the same way, so every
combination of its values is judged by this one rule: the same local graph, whatever meets in it.
"""

from __future__ import annotations

import torch

from conformance.models import dist_autograd as fns
from conformance.models import dist_autograd_composed as composed
from conformance.spec import Scenario


def oracle(scenario: Scenario, kind: str, caller: int = 0) -> dict:
    """Local autograd over the same composition: {name: grad or None} (None: unused).
    `caller`: the worker whose context runs it, with its own leaves (`contexts-meet`: worker 1's
    are those of seed + PEER_SEED)."""
    seed = scenario.seed
    leaves = composed.leaves_of(scenario, kind, seed + caller * fns.PEER_SEED)
    fns.reset_params("local")
    roots = composed.composition_of(scenario, kind)("local", seed, leaves)
    params = fns.owned_params("local", seed)
    named = {f"{n}@worker{caller}": t for n, t in leaves.items()}
    named.update({f"{n}@worker{fns.owner(n)}": t for n, t in params.items()})
    grads = torch.autograd.grad(roots, list(named.values()), allow_unused=True)
    return {n: (None if g is None else g.detach().clone()) for n, g in zip(named, grads, strict=True)}
