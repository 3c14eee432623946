"""Sharded data parallelism (docs/contracts/sharded.md): the DDP contract on gathered gradients and
parameters, plus each rank's own shards (`conformance.judge.shards`).
"""

from conformance.areas.entry import AreaEntry

AREA = AreaEntry(
    name="sharded",
    order=4,
    about="the DDP contract on gathered (unsharded) grads and params",
    catalogue="conformance.catalogue.sharded:handwritten",
    runner="conformance.runners.ddp",
    oracle="conformance.oracle.baseline:compute",
    adapters={
        "refimpl-sharded": "conformance.adapters.sharded:refimpl_sharded",
        "refimpl-zero3": "conformance.adapters.sharded:refimpl_zero3",
        "torch-fsdp": "conformance.adapters.sharded:torch_fsdp",
        "torch-fsdp2": "conformance.adapters.sharded_fsdp2:torch_fsdp2",
    },
    mutants="conformance.mutants.sharded",
    controls=("refimpl-sharded",),
    independent="conformance.mutants.independent.sharded",
    interactions="conformance.mutants.independent.interactions_sharded",
)
