"""The `data_parallel` area's oracle forward: the module on the full batch, or chunk by chunk.

`data_parallel` replicates a module and runs each replica on one chunk of the batch; the oracle
is the original module run once on the whole batch, or, for models whose forward is not
batch-separable (BatchNorm in train mode: `spec.oracle == "per-chunk"`), on each chunk in turn,
with only replica 0's buffer updates kept, as the original module keeps them. The replicas'
gradients and buffers are judged by `conformance.oracle.replica_oracle`.
"""

from __future__ import annotations

import torch


def oracle_forward(oracle, inputs: tuple, spec, replicas: int, module_kwargs: dict | None = None):
    """The module on the full batch, or ("per-chunk") on each equal chunk in turn, gathered."""
    if spec.oracle != "per-chunk":
        return oracle(*inputs, **(module_kwargs or {}))
    chunks = [tuple(t.chunk(replicas, spec.dim)[j] for t in inputs) for j in range(replicas)]
    outs = [oracle(*chunks[0])]  # replica 0's buffer updates are the ones the original keeps
    for args in chunks[1:]:  # the others update copies of the buffers, thrown away
        copies = {n: b.clone() for n, b in oracle.named_buffers()}
        outs.append(torch.func.functional_call(oracle, copies, args))
    if all(o.dim() == 0 for o in outs):
        return torch.stack(outs)
    return torch.cat(outs, spec.dim)
