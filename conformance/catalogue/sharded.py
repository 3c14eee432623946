"""The `sharded` scenario catalogue: the DDP contract, checked on gathered gradients and
parameters (issue 6).

The scenarios are the DDP catalogue's (`conformance.catalogue.ddp.scenarios(area="sharded")`,
ids `sharded/...`), minus what is DDP machinery rather than data-parallel semantics:
comm hooks, `gradient_as_bucket_view`, `static_graph` and sparse gradients (no sharded
implementation here offers them; refimpl's sharded engine rejects sparse gradients by design).
Bucket-cap scenarios stay: they need `bucket_cap_mb`, which only refimpl-sharded declares
(FSDP's unit of communication is the wrapped module, not a byte cap), so FSDP skips them
with the capability named.

Buffers: the oracle models DDP's rule (rank 0's buffers broadcast before every forward, and
every rank's buffers checked after each step). Scenarios whose model has buffers ("buffered":
forward reads a buffer it updates; "cnn-bn": BatchNorm running statistics) therefore require
`broadcast_buffers`. FSDP1/FSDP2 sync buffers once at construction and never again (each
rank keeps its own running statistics), so they skip them with the capability named.

Exactness: as for DDP — bitwise at world size <= 2 (sharding changes where the sum of two
terms is computed, not its value), tolerance scaled by the summands at 3 and 4.
"""

from __future__ import annotations

from conformance.catalogue import ddp
from conformance.spec import Capability as C
from conformance.spec import Scenario

# Models with buffers that training updates (see the module docstring).
BUFFER_READING_MODELS = {"buffered", "cnn-bn"}
# The quick profile is part of every default `gradparity run` (three sharded adapters):
# one scenario per concern; the DDP catalogue's other quick ones run in standard.
QUICK_IDS = {
    "sharded/plain/mlp/w2/fp32",
    "sharded/adam/mlp/w2/fp32",
    "sharded/no-sync/mlp/w2/fp32",
    "sharded/unused-on-rank1/branches/w2/fp32",
    "sharded/bucket-over-cap/big-param/w2/fp32",
}


def applies(s: Scenario) -> bool:
    o = s.options
    return not (o.comm_hook or o.gradient_as_bucket_view or o.static_graph or C.SPARSE in s.requires)


def scenarios() -> list[Scenario]:
    out = []
    for s in ddp.scenarios(area="sharded"):
        if not applies(s):
            continue
        if s.model in BUFFER_READING_MODELS:
            s = s.with_(requires=s.requires | {C.BUFFER_BROADCAST})
        if "quick" in s.profiles and s.id not in QUICK_IDS:
            s = s.with_(profiles=s.profiles - {"quick"})
        out.append(s)
    return out
