"""`pfn-ddp`: `pytorch_pfn_extras.nn.parallel.DistributedDataParallel` (ppe), driven like torch DDP.

ppe takes torch DDP's constructor keywords but ignores most of them (bucket_cap_mb,
find_unused_parameters, gradient_as_bucket_view, static_graph: it logs "ignores ..."), so the
scenarios that exercise those options are skipped for lack of the capability rather than
passed on an option that did nothing. Its comm hooks take the module (`hook(ddp)`), not torch's
`(state, GradBucket)`, and it has no sparse-gradient path.

Declared (from ppe's own docstring, `pytorch_pfn_extras/nn/parallel/distributed.py`):
"broadcast_buffers: Boolean flag to broadcast buffers after backward computations" — rank 0's
parameters and buffers are broadcast in the constructor, and buffers again after each synced
backward (not before forward, as torch DDP does).
"""

from __future__ import annotations

from conformance.adapters.ddp_like import DDPLikeAdapter, DDPLikeWrapped
from conformance.adapters.engines import probe
from conformance.semantics import Buffers, Scaling, Semantics
from conformance.spec import Capability as C

INSTALL = "pip install -c constraints.txt 'gradparity[pfn]'  (pytorch-pfn-extras)"
SEMANTICS = Semantics(
    buffers=Buffers.AFTER_BACKWARD,
    scaling=Scaling.POST,
    sources=("pytorch_pfn_extras.nn.parallel.DistributedDataParallel docstring: "
             "'broadcast_buffers: Boolean flag to broadcast buffers after backward computations'",
             "pytorch_pfn_extras/nn/parallel/distributed.py _reduce: all_reduce of the coalesced sum, "
             "then multi_tensor_scale by 1.0 / world_size (1/W after the sum)"),
)
CAPABILITIES = frozenset({C.NO_SYNC, C.FIND_UNUSED, C.BUFFER_BROADCAST, C.HALF_PRECISION, C.ENGINE_ZERO_GRAD})


class PfnAdapter(DDPLikeAdapter):
    semantics = SEMANTICS

    def __init__(self):
        self.version, self._why = probe("pytorch_pfn_extras", "pytorch-pfn-extras", INSTALL)
        self.name, self.cls, self.capabilities = "pfn-ddp", None, CAPABILITIES
        self._comm_hooks = dict

    def unavailable(self, scenario) -> str | None:
        return self._why

    def wrap(self, module, ctx, options, optimizer=None) -> DDPLikeWrapped:
        from pytorch_pfn_extras.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(module, broadcast_buffers=options.broadcast_buffers, process_group=ctx.group)
        return DDPLikeWrapped(ddp)


def pfn_ddp() -> PfnAdapter:
    return PfnAdapter()
