"""An adapter's verdict (conformance/report/verdict.py): a skipped case is never a pass; a run, or
an adapter named on the command line, that checked nothing exits 2 with the reason; the terminal
and the HTML print skip and xfail reasons themselves and label the expected failures' classes."""

import io
from collections import Counter

from rich.console import Console

from conformance.report.html import render as render_html
from conformance.report.json_report import build_report
from conformance.report.terminal import render as render_terminal
from conformance.report.verdict import (
    CONFORMANT,
    INCOMPLETE,
    NOT_CONFORMANT,
    NOTHING_CHECKED,
    adapter_verdict,
    exit_reason,
    nothing_checked,
)


def _r(adapter, scenario, verdict, **extra):
    return {"adapter": adapter, "scenario": scenario, "case": f"{adapter}|{scenario}", "verdict": verdict, "area": "ddp",
            "device": "cpu", "world_size": 2, "seed": 0, "options": "", "tolerance": "bitwise"} | extra


SKIPPED = [_r("torch-data-parallel", f"data_parallel/s{i}/w1/fp32", "skipped", message="needs CUDA: torch's DataParallel")
           for i in range(3)]
PASSED = [_r("torch-ddp", "ddp/plain/mlp/w2/fp32", "passed")]
XFAILED = [_r("torch-ddp", "ddp/reduce-bf16/mlp/w2/fp32", "xfailed", failure_class="raised", cause="RuntimeError: events",
              xfail_reason="mixed_precision needs CUDA events on torch DDP")]


def test_every_case_skipped_is_nothing_checked_never_conformant():
    assert adapter_verdict(Counter(skipped=19)) == NOTHING_CHECKED
    assert adapter_verdict(Counter(skipped=18, xfailed=1)) == CONFORMANT  # an expected failure ran
    assert adapter_verdict(Counter(skipped=2, failed=1)) == NOT_CONFORMANT
    assert adapter_verdict(Counter(skipped=2), stopped=True) == INCOMPLETE
    assert nothing_checked(SKIPPED + PASSED) == {
        "torch-data-parallel": "all 3 case(s) skipped (3: needs CUDA: torch's DataParallel)"}


def test_exit_2_when_the_run_or_a_named_adapter_checked_nothing():
    assert exit_reason(SKIPPED, named=[]).startswith("nothing checked: every case of the run was skipped (3: needs CUDA")
    assert exit_reason(SKIPPED + PASSED, named=[]) is None  # a default adapter the machine cannot run: its verdict only
    assert exit_reason(SKIPPED + PASSED, named=["torch-data-parallel", "torch-ddp"]).startswith(
        "nothing checked for torch-data-parallel: all 3 case(s) skipped")
    assert exit_reason(PASSED + XFAILED, named=["torch-ddp"]) is None


def _terminal(results, **kw) -> str:
    out = io.StringIO()
    render_terminal(Console(file=out, width=200, force_terminal=False, emoji=False), results, None, [], **kw)
    return out.getvalue()


def test_the_terminal_says_why_and_labels_expected_failures():
    text = _terminal(SKIPPED + PASSED + XFAILED, exit_reason="nothing checked for torch-data-parallel: ...")
    assert "torch-data-parallel: 3 skipped: needs CUDA: torch's DataParallel" in text
    assert "torch-data-parallel: nothing checked: all 3 case(s) skipped" in text
    assert "x torch-ddp|ddp/reduce-bf16/mlp/w2/fp32: [expected raised] expected failure: mixed_precision needs" in text
    assert "expected failures' classes (not failures of this run): raised 1" in text
    assert "exit status 2: nothing checked for torch-data-parallel" in text
    row = next(line for line in text.splitlines() if line.startswith("│ torch-data-parallel"))
    assert NOTHING_CHECKED in row and CONFORMANT not in row


def test_the_html_marks_nothing_checked_grey_and_labels_expected_classes():
    report = build_report(SKIPPED + PASSED + XFAILED, adapters=["torch-ddp", "torch-data-parallel"],
                          run_info={"nothing_checked": None})
    assert report["summary"]["failure_classes"]["raised"] == 0  # the expected failure's class is not a failure
    assert report["summary"]["expected_failure_classes"]["raised"] == 1
    assert report["summary"]["verdicts"] == {"torch-data-parallel": NOTHING_CHECKED, "torch-ddp": CONFORMANT}
    assert [a["verdict"] for a in report["adapters"]] == [CONFORMANT, NOTHING_CHECKED]
    page = render_html(report)
    assert "torch-data-parallel: nothing checked</b>" in page and "failure classes (failures of this run)" not in page
    assert "expected failures&#39; classes (listed known failures, not failures of this run): raised: 1" in page
    assert '<td style="color:#9e9e9e"><b>nothing checked</b>' in page  # grey, as a skip; never the pass green
