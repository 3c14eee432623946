"""Planning (conformance/plan.py): the same selection gives the same cases, skip reasons and
expected failures to every front end."""

from conformance.adapters import registry
from conformance.plan import Selection, make_plan, plan_cases

PLAIN, NO_SYNC = "ddp/plain/mlp/w2/fp32", "ddp/no-sync/mlp/w2/fp32"
UNUSED = "ddp/unused-without-fuf/branches/w2/fp32"


def _by_id(cases):
    return {c.id: c for c in cases}


def test_cases_are_scenarios_times_adapters_of_their_area():
    cases = plan_cases(Selection(adapters=("torch-ddp", "refimpl-bucketer"), ids=(PLAIN, "bucketer/oversized/0.01mb/w2/fp32")))
    assert sorted(c.id for c in cases) == ["refimpl-bucketer|bucketer/oversized/0.01mb/w2/fp32", f"torch-ddp|{PLAIN}"]
    default = plan_cases(Selection(ids=(PLAIN,)))
    assert {c.adapter_spec for c in default} == {s for s in registry.DEFAULT_ADAPTERS if registry.load(s).area == "ddp"}


def test_a_missing_capability_is_a_skip_that_names_it(tmp_path):
    (tmp_path / "minimal_ddp.py").write_text(
        "import torch.nn.parallel\n"
        "class Minimal(torch.nn.parallel.DistributedDataParallel):\n"
        "    gradparity_capabilities = frozenset()\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        spec = registry.ddp_class_spec("minimal_ddp:Minimal")
        cases = _by_id(plan_cases(Selection(adapters=(spec,), ids=(PLAIN, NO_SYNC))))
    finally:
        sys.path.remove(str(tmp_path))
    assert cases[f"{spec}|{NO_SYNC}"].skip == "Minimal lacks capability: no_sync"
    assert cases[f"{spec}|{PLAIN}"].skip == ""


def test_builtin_and_user_lists(tmp_path):
    xfails, skips = tmp_path / "xfails.txt", tmp_path / "skips.txt"
    xfails.write_text(f"refimpl-ddp|{PLAIN}  # mine\ntorch-ddp|ddp/does-not-exist  # stale\n")
    skips.write_text(f"conformance/suite/test_ddp.py::test_ddp[torch-ddp|{NO_SYNC}]  # node id form\n")
    plan = make_plan(Selection(adapters=("torch-ddp", "refimpl-ddp"), profile="quick",
                               xfail_files=(str(xfails),), skip_files=(str(skips),)))
    cases = _by_id(plan.cases)
    assert "128949" in cases[f"torch-ddp|{UNUSED}"].xfail  # the built-in list of torch-ddp
    assert cases[f"refimpl-ddp|{UNUSED}"].xfail is None  # ... applies to torch-ddp only
    assert cases[f"refimpl-ddp|{PLAIN}"].xfail == "mine"
    assert cases[f"torch-ddp|{NO_SYNC}"].skip == "node id form"
    assert plan.unmatched == ["xfails.txt: xfail entry 'torch-ddp|ddp/does-not-exist' matches no collected case"]


def test_a_star_in_an_entry_names_every_generated_row_holding_the_pair(tmp_path):
    """Generated rows' ids say their values, and an array regenerates with other rows: an entry
    for a pair (`*static-on*accum-*`) names it wherever the array puts it; other characters of an
    id (`+`, `.`, `[`) are literal, and a pattern that names nothing is stale."""
    from conformance import catalogue

    pairs = [s.id for s in catalogue.select(profile="standard") if s.id.startswith("ddp/pairs/")]
    wanted = {i for i in pairs if "static-on" in i and "+accum-" in i}
    assert wanted and len(wanted) < len(pairs)
    xfails = tmp_path / "xfails.txt"
    xfails.write_text("refimpl-ddp|ddp/pairs/*static-on*accum-*  # the pair\n"
                      "refimpl-ddp|ddp/pairs/mlp+w2*  # '+' is literal: names nothing\n")
    plan = make_plan(Selection(adapters=("refimpl-ddp",), profile="standard", areas=("ddp",),
                               xfail_files=(str(xfails),), builtin_xfails=False))
    marked = {c.scenario.id for c in plan.cases if c.xfail == "the pair"}
    assert marked == wanted
    assert plan.unmatched == ["xfails.txt: xfail entry 'refimpl-ddp|ddp/pairs/mlp+w2*' matches no collected case"]


def test_entries_for_cases_outside_the_selection_are_not_stale():
    plan = make_plan(Selection(adapters=("torch-ddp",), ids=(PLAIN,)))
    assert plan.unmatched == []  # the built-in list names cases of every profile


def test_under_torchrun_a_world_ending_expected_failure_is_skipped_with_its_reason():
    """torch-ddp's #40566 aborts a rank: the pool respawns a world, a torchrun world cannot."""
    from conformance.frontends.torchrun import _order

    ends = "ddp/rank-uses-no-param/branches/w2/fp32"
    cases = _by_id(_order(plan_cases(Selection(adapters=("torch-ddp",), ids=(PLAIN, UNUSED, ends)))))
    skipped = cases[f"torch-ddp|{ends}"]
    assert skipped.xfail is None and "not run under torchrun" in skipped.skip and "40566" in skipped.skip
    assert cases[f"torch-ddp|{UNUSED}"].xfail and not cases[f"torch-ddp|{UNUSED}"].skip  # still run, last
    assert list(cases)[-1] == f"torch-ddp|{UNUSED}" and not cases[f"torch-ddp|{PLAIN}"].skip


def test_every_builtin_expected_crash_or_hang_is_marked_as_ending_the_world():
    import glob
    import os
    import re

    from conformance.expectations import XFAILS_DIR, ends_world, read_expectations

    for path in glob.glob(os.path.join(XFAILS_DIR, "*.txt")):
        for case, reason in read_expectations(path).items():
            if re.search(r"abort|hang|crash", reason, re.I):
                assert ends_world(reason), f"{case}: mark its reason 'ends-world:' ({os.path.basename(path)})"
