"""The bucketer contract (conformance.catalogue.bucketer): every callback exactly once by
flush() with the exact sum over ranks of its chunk, results that stay valid, and the callback
order both FairScale and refimpl document."""

from conformance.frontends.plugin import run_suite_case

AREA = "bucketer"


def test_bucketer(gp_case, request):
    run_suite_case(request)
