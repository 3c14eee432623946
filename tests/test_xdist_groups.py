"""The test run's `--dist loadgroup` keeps each `xdist_group` on one worker.

Tests that share a module fixture (the quick zoo, 6 minutes on 2 cores), ports or process
hygiene rely on it. pytest-xdist marks a group by suffixing the node id; on pytest 9.2 that
suffix no longer takes (pytest-dev/pytest-xdist#1386) and the groups spread over the workers
without a word, so this says it: constraints.txt pins pytest below 9.2 until xdist is fixed.
"""

import pytest


@pytest.mark.xdist_group("xdist-groups")
def test_xdist_groups_are_honoured(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run under pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@xdist-groups"), (
        f"pytest {pytest.__version__} with this pytest-xdist ignores xdist_group marks "
        "(pytest-dev/pytest-xdist#1386): install through constraints.txt (pytest<9.2)")
