"""An adapter author's expectation files: entries by adapter name, warnings under --scenario, and
user strings shown as text (no rich markup or emoji codes)."""

from __future__ import annotations

import io

from rich.console import Console

from conformance.plan import Selection, make_plan
from conformance.report.terminal import render

PLAIN = "ddp/plain/mlp/w2/fp32"
SPEC = "conformance.adapters.engines.torch_zero:torch_zero"  # its name is "torch-zero"


def test_an_entry_may_name_the_adapter_instead_of_its_import_path(tmp_path):
    xfails = tmp_path / "xfails.txt"
    xfails.write_text(f"torch-zero|{PLAIN}  # by name\n")
    plan = make_plan(Selection(adapters=(SPEC,), ids=(PLAIN,), xfail_files=(str(xfails),), builtin_xfails=False))
    (case,) = plan.cases
    assert case.id == f"{SPEC}|{PLAIN}" and case.xfail == "by name"
    assert plan.unmatched == []


def test_under_scenario_a_misspelt_entry_for_the_selected_scenario_warns(tmp_path):
    xfails = tmp_path / "xfails.txt"
    xfails.write_text(f"torch-zer0|{PLAIN}  # typo\ntorch-zero|ddp/no-sync/mlp/w2/fp32  # another scenario\n")
    plan = make_plan(Selection(adapters=(SPEC,), ids=(PLAIN,), xfail_files=(str(xfails),), builtin_xfails=False))
    assert plan.unmatched == []  # the typo names no selected adapter; the other entry is not selected
    xfails.write_text(f"torch-zero|{PLAIN}.  # wrong scenario id for the selected one\n")
    plan = make_plan(Selection(adapters=(SPEC,), ids=(PLAIN,), xfail_files=(str(xfails),), builtin_xfails=False))
    assert plan.unmatched and "matches no collected case" in plan.unmatched[0]


def test_user_strings_are_not_rich_markup():
    out = io.StringIO()
    results = [{"adapter": "mypkg.adapters:factory:", "verdict": "failed", "case": "mypkg.adapters:factory:|x",
                "cause": "[bold]not markup[/] :factory:", "failure_class": "wrong value"}]
    render(Console(file=out, width=200, emoji=False), results, None, [])
    text = out.getvalue()
    assert "mypkg.adapters:factory:" in text and "\N{FACTORY}" not in text
    assert "[bold]not markup[/]" in text


def test_a_long_adapter_spec_wraps_in_the_summary_and_is_never_cut():
    """Found by the Lightning Fabric newcomer run: the table showed `lightning_fabric_adapt…`."""
    spec = "lightning_fabric_adapter:factory_with_a_long_name"
    out = io.StringIO()
    render(Console(file=out, width=100, emoji=False), [{"adapter": spec, "verdict": "passed", "case": f"{spec}|x"}], None, [])
    text = "".join(line.strip(" │|") for line in out.getvalue().splitlines())
    assert "…" not in out.getvalue() and "lightning_fabric_adapter:fa" in text


def test_under_k_an_entry_the_expression_selects_but_the_profile_lacks_warns(tmp_path):
    """`-k tied-bf16` on the quick profile runs nothing of that scenario (it is standard-only): a user's
    xfail for it is silently unused unless said."""
    xfails = tmp_path / "xfails.txt"
    standard_only = "ddp/tied-bf16/tied/w2/bf16"
    xfails.write_text(f"torch-zero|{standard_only}  # mine\ntorch-zero|ddp/fp16-params/mlp/w2/fp16  # not selected\n")
    plan = make_plan(Selection(adapters=(SPEC,), profile="quick", keyword="tied-bf16", xfail_files=(str(xfails),),
                               builtin_xfails=False))
    assert len(plan.unmatched) == 1 and standard_only in plan.unmatched[0] and "-k 'tied-bf16'" in plan.unmatched[0]
    for keyword in ("", "plain", "tied-bf16 and not torch_zero"):  # not selected by -k (the case id holds the spec): quiet
        plan = make_plan(Selection(adapters=(SPEC,), profile="quick", keyword=keyword, xfail_files=(str(xfails),),
                                   builtin_xfails=False))
        assert plan.unmatched == [], keyword
    plan = make_plan(Selection(adapters=(SPEC,), profile="full", keyword="tied-bf16", xfail_files=(str(xfails),),
                               builtin_xfails=False))
    assert not any(standard_only in m for m in plan.unmatched)  # in the profile (full since #38): it matched its case


def test_under_k_built_in_lists_stay_quiet():
    """Built-in lists name cases of every profile; -k on a smaller profile is not their mistake."""
    plan = make_plan(Selection(adapters=("deepspeed-zero3",), profile="quick", keyword="transformer"))
    assert plan.unmatched == []
