"""The DDP contract for sharded data parallel (DESIGN.md): checked on the *gathered*
gradients and parameters — construction sync, averaged gradients after every synced backward,
local accumulation under no_sync, bitwise-identical ranks."""

from conformance.frontends.plugin import run_suite_case

AREA = "sharded"


def test_sharded(gp_case, request):
    run_suite_case(request)
