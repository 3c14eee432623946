"""The DDP contract (docs/contracts/ddp.md): torch's DistributedDataParallel and anything that wraps a
module the same way; the sharded area reuses its runner and oracle.
"""

from conformance.areas.entry import AreaEntry

AREA = AreaEntry(
    name="ddp",
    order=0,
    about="the DDP contract: construction sync, averaged grads, no_sync, unused parameters, buffers",
    catalogue="conformance.catalogue.ddp:handwritten",
    runner="conformance.runners.ddp",
    oracle="conformance.oracle.baseline:compute",
    adapters={
        "torch-ddp": "conformance.adapters.ddp_like:torch_ddp",
        "refimpl-ddp": "conformance.adapters.ddp_like:refimpl_ddp",
    },
    mutants="conformance.mutants.ddp",
    controls=("torch-ddp", "refimpl-ddp"),
    independent="conformance.mutants.independent.ddp",
    interactions="conformance.mutants.independent.interactions_ddp",
)
