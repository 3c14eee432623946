"""The DDP contract (DESIGN.md): construction sync, averaged gradients after every synced
backward, local accumulation under no_sync, bitwise-identical ranks, rank 0's buffers."""

from conformance.frontends.plugin import run_suite_case

AREA = "ddp"


def test_ddp(gp_case, request):
    run_suite_case(request)
