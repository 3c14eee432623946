"""The reduce-scatter bucketer (docs/contracts/bucketer.md): FairScale's `ReduceScatterBucketer`
contract, callbacks and their order.
"""

from conformance.areas.entry import AreaEntry

AREA = AreaEntry(
    name="bucketer",
    order=3,
    about="bucketed reduce-scatter = exact sum of chunks; callbacks exactly once, in order",
    catalogue="conformance.catalogue.bucketer:handwritten",
    runner="conformance.runners.bucketer",
    oracle="conformance.oracle.bucketer:expected_result",
    adapters={
        "refimpl-bucketer": "conformance.adapters.bucketer:refimpl_bucketer",
        "fairscale-bucketer": "conformance.adapters.bucketer:fairscale_bucketer",
    },
    mutants="conformance.mutants.bucketer",
    controls=("refimpl-bucketer", "fairscale-bucketer"),
    independent="conformance.mutants.independent.bucketer",
    interactions="conformance.mutants.independent.interactions_bucketer",
)
