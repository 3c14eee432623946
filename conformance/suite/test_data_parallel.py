"""The data_parallel contract: the original module's gradients (and the gathered output)
after a data_parallel forward/backward equal a plain forward/backward on the full batch."""

from conformance.frontends.plugin import run_suite_case

AREA = "data_parallel"


def test_data_parallel(gp_case, request):
    run_suite_case(request)
