"""Scenarios for the user's own model (`--model/--batch/--loss`, `conformance.check_model`).

Only the families that need no catalogue-specific model: plain SGD, Adam, no_sync accumulation,
uneven shards (odd ranks keep the first half of their batch), a long run, autocast, a
checkpoint round trip, gradient clipping and (opt-in, slow) torch.compile, at the world sizes
asked. The user's weights and inputs are continuous, so the rules are the continuous-data ones:
at two ranks the sum of two shares is order-free (bitwise); from three, bitwise to one summation
order (`summation_order`); torch.compile keeps its band (its kernels may reorder reductions).

A model whose forward leaves a parameter without a gradient (found by `inspect` before any
process starts) runs with find_unused_parameters. Case ids name the user's build reference:
`ddp/plain/mypkg.models:build/w2/fp32`.
"""

from __future__ import annotations

from dataclasses import replace

from conformance.catalogue.ddp_scenario import make
from conformance.catalogue.profiles import QUICK
from conformance.spec import Capability, Scenario, WrapOptions, float_tolerance, summation_order

# family -> (scenario fields, features); "optimizer" None takes the run's --optimizer
FAMILIES: dict[str, tuple[dict, dict]] = {
    "plain": ({"steps": 3}, {}),
    "adam": ({"steps": 3, "optimizer": "adam"}, {}),
    "no-sync": ({"steps": 2, "micro_batches": 2}, {}),
    "uneven": ({"steps": 2}, {}),
    "long": ({"steps": 12, "optimizer": "adam"}, {}),
    "autocast-bf16": ({"steps": 3}, {"autocast": "bfloat16"}),
    "checkpoint-round-trip": ({"steps": 4, "optimizer": "adam"}, {"save_load_at": 2}),
    "clip-grad-norm": ({"steps": 3}, {"clip": 1.0}),
    "compile-model": ({"steps": 3}, {"compile": "model"}),
}
DEFAULT_FAMILIES = tuple(f for f in FAMILIES if f != "compile-model")  # compile: opt-in (minutes on a laptop)


def scenarios(model: str, name: str, *, world_sizes=(2,), families=DEFAULT_FAMILIES, optimizer: str = "sgd",
              batch_size: int = 4, find_unused: bool = False, randomness: tuple[str, ...] = (),
              area: str = "ddp", has_buffers: bool = False) -> list[Scenario]:
    """Scenarios for the encoded user model `model`, named `name` in their ids, in `area` ("ddp",
    or "sharded": the same contract on gathered tensors, buffers needing a broadcast rule)."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    options = WrapOptions(find_unused_parameters=find_unused)
    out = []
    for w in world_sizes:
        for family in families:
            if family == "compile-model" and "torch" in randomness:
                continue  # compile draws dropout masks with its own generator: not replayable (said before the run)
            if family == "uneven" and (w < 2 or batch_size < 2):
                continue
            fields, features = FAMILIES[family]
            fields = {**fields, "optimizer": fields.get("optimizer") or optimizer}
            if area == "sharded" and "save_load_at" in features:  # the engine's own full state dict (S15)
                features = {**features, "state_dict": "full"}
                fields["extra_requires"] = frozenset({Capability.STATE_DICT})
            if family == "uneven":
                fields["shard_sizes"] = tuple(batch_size if r % 2 == 0 else batch_size // 2 for r in range(w))
            else:
                fields["shard_sizes"] = (0,) * w  # 0: the user's batch as given
            tolerance = (float_tolerance("float32", max(w, 2), "torch.compile: reductions may be reordered")
                         if family == "compile-model" else summation_order("float32", w))
            s = make(family, name, w=w, profiles=QUICK, options=options, exact_data=False, tolerance=tolerance,
                     features=tuple(sorted(features.items())), area=area, **fields)
            if area == "sharded":  # as conformance.catalogue.sharded does for its scenarios
                if has_buffers:
                    s = s.with_(requires=s.requires | {Capability.BUFFER_BROADCAST})
                if s.tolerance.kind == "summation-order":
                    s = s.with_(tolerance=replace(s.tolerance, divide=("pre", "post", "split")))
            out.append(s.with_(model=model, description=f"your model: {family} at {w} rank(s)"))
    return out
