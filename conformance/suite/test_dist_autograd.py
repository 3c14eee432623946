"""The dist_autograd contract: gradients in the distributed autograd contexts (on every worker)
equal local autograd over the same composition; retained passes accumulate; a remote failure
surfaces as 'Error on Node N' on the caller and leaves no context behind."""

from conformance.frontends.plugin import run_suite_case

AREA = "dist_autograd"


def test_dist_autograd(gp_case, request):
    run_suite_case(request)
