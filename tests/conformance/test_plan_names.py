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
