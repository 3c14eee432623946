"""Single-process data parallelism (docs/contracts/data_parallel.md): `data_parallel(module, inputs,
devices, output_device, dim)`; one process drives every replica, so the task runs in the coordinator.
"""

from conformance.areas.entry import AreaEntry

AREA = AreaEntry(
    name="data_parallel",
    order=1,
    about="single-process replicate/scatter/gather vs one full-batch backward",
    catalogue="conformance.catalogue.data_parallel:handwritten",
    runner="conformance.runners.data_parallel",
    oracle="conformance.oracle.data_parallel:oracle_forward",
    adapters={
        "refimpl-data-parallel": "conformance.adapters.data_parallel:refimpl_data_parallel",
        "torch-data-parallel": "conformance.adapters.data_parallel:torch_data_parallel",
    },
    mutants="conformance.mutants.data_parallel",
    controls=("refimpl-data-parallel",),
    independent="conformance.mutants.independent.data_parallel",
    interactions="conformance.mutants.independent.interactions_data_parallel",
    in_process=True,
)
