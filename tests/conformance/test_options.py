"""One options definition (conformance/frontends/options.py) for argparse, pytest and torchrun."""

import argparse

import pytest

from conformance.frontends import options, torchrun
from conformance.validation import UsageError


def test_argparse_pytest_and_torchrun_share_every_option():
    from conformance.frontends.cli import _parser

    run = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    cli = {a.dest for a in run._actions}
    launcher = {a.dest for a in torchrun._parser()._actions}
    shared = {o.dest for o in options.OPTIONS}
    assert shared <= cli and shared <= launcher

    added = {}

    class Group:
        def addoption(self, flag, **kwargs):
            added[kwargs["dest"]] = (flag, kwargs.get("default"))

    options.add_to_pytest(Group())
    assert set(added) == shared
    assert added["report_dir"] == ("--gradparity-report-dir", None)  # pytest writes reports only when asked


@pytest.mark.parametrize("argv, needle", [
    (["--adapter", "nope"], "unknown adapter 'nope'"),
    (["--scenario", "ddp/none/such"], "unknown scenario 'ddp/none/such'"),
    (["--world-size", "0"], "impossible world size 0"),
    (["--xfails", "/nonexistent/x.txt"], "does not exist"),
])
def test_selection_refuses_bad_input_with_one_line(argv, needle):
    args = torchrun._parser().parse_args(argv)
    with pytest.raises(UsageError, match=needle) as info:
        options.selection(args, check_reports=False)
    assert "\n" not in str(info.value)


def test_selection_carries_what_was_asked():
    args = torchrun._parser().parse_args(["--ddp-class", "torch.nn.parallel:DistributedDataParallel", "--profile",
                                          "standard", "--world-size", "2", "--area", "ddp"])
    chosen = options.selection(args, areas=args.area, check_reports=False)
    assert chosen.adapters == ("ddp-class=torch.nn.parallel:DistributedDataParallel",)
    assert (chosen.profile, chosen.world_sizes, chosen.areas) == ("standard", (2,), ("ddp",))
