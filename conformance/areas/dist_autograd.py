"""Distributed autograd over RPC (docs/contracts/dist_autograd.md): contexts, backward across workers,
the gradients each context holds; RPC runs on CPU whatever the run's device.
"""

from conformance.areas.entry import AreaEntry

AREA = AreaEntry(
    name="dist_autograd",
    order=2,
    about="gradients in distributed-autograd contexts vs local autograd over the same composition",
    catalogue="conformance.catalogue.dist_autograd:handwritten",
    runner="conformance.runners.dist_autograd",
    oracle="conformance.oracle.dist_autograd:oracle",
    adapters={
        "refimpl-dist-autograd": "conformance.adapters.dist_autograd:refimpl_dist_autograd",
        "torch-dist-autograd": "conformance.adapters.dist_autograd:torch_dist_autograd",
    },
    mutants="conformance.mutants.dist_autograd",
    controls=("refimpl-dist-autograd", "torch-dist-autograd"),
    independent="conformance.mutants.independent.dist_autograd",
    interactions="conformance.mutants.independent.interactions_dist_autograd",
    rank_device="cpu",
)
