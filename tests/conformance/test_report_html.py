"""The HTML report, its upstream links and bucket timelines, and the terminal summary, from records."""

from __future__ import annotations

import io
import re

from rich.console import Console

from conformance.judge.failure import Classified, FailureClass
from conformance.report import html, links, terminal, timeline
from conformance.report.json_report import build_report
from conformance.report.record import case_record, lost_case_record
from tests.conformance.test_report import REASON, SCENARIO, SEEN, _records

STATS = {"buckets": [
    {"index": 0, "nbytes": 4096, "ready_ns": 1_000_000, "launch_ns": 1_500_000, "finish_ns": 4_000_000},
    {"index": 1, "nbytes": 1024, "ready_ns": 2_000_000, "launch_ns": 3_000_000, "finish_ns": 6_000_000},
], "backward_end_ns": 5_000_000}


def _report(results=None) -> dict:
    results = _records() if results is None else results
    return build_report(results, adapters=sorted({r["adapter"] for r in results}), profile="quick",
                        run_info={"command": "gradparity run", "commit": "abc123", "adapters": []})


def test_upstream_references_become_links_and_the_rest_is_escaped():
    text = "zeros (pytorch/pytorch#40566), see FairScale#354 and https://example.org/a?b=1 <b>"
    out = links.linkify(text)
    assert '<a href="https://github.com/pytorch/pytorch/issues/40566">pytorch/pytorch#40566</a>' in out
    assert '<a href="https://github.com/facebookresearch/fairscale/issues/354">FairScale#354</a>' in out
    assert '<a href="https://example.org/a?b=1">https://example.org/a?b=1</a>' in out
    assert "&lt;b&gt;" in out and "<b>" not in out
    assert links.linkify("ddp/plain/mlp/w2/fp32 step #3") == "ddp/plain/mlp/w2/fp32 step #3"


def test_skip_and_xfail_reasons_are_written_out_not_only_in_tooltips():
    page = html.render(_report())
    notes = re.search(r'<ol class="reasons">(.*?)</ol>', page).group(1)
    assert "skipped: refimpl-sharded lacks capability: no_sync" in notes
    assert "expected failure: zeros instead of None (" in notes and "issues/40566" in notes
    # the expected failure's table row: the reason beside the error actually seen
    row = re.search(r"<h2>Expected failures</h2>.*?</table>", page, re.S).group(0)
    assert "issues/40566" in row and "rank 1, step 0: grad of &#x27;fc1.weight&#x27; differs" in row
    assert "abc123" in page and "gradparity run" in page  # provenance


def test_one_timeline_per_adapter_with_a_time_axis_or_a_note_why_not():
    records = _records()
    with_stats = [case_record("refimpl-ddp", SCENARIO, verdict="passed", message="", duration_s=0.1)]
    with_stats[0]["details"] = {"backward_stats": {"0": STATS}}
    small = dict(with_stats[0], case="refimpl-ddp|other", scenario="ddp/other/mlp/w2/fp32",
                 details={"backward_stats": {"0": dict(STATS, buckets=STATS["buckets"][:1])}})
    section = timeline.section(_report(records + with_stats + [small]))
    assert section.count("<svg") == 1  # one figure for refimpl-ddp: the case with the most buckets
    assert "ddp/plain/mlp/w2/fp32</code>, rank 0's last backward, 2 bucket(s)" in section
    assert "1 other passing case(s)" in section
    assert ">0 ms<" in section and ">6 ms<" in section  # the time axis, round ticks
    assert "bucket 0 · 4.0 KiB" in section
    assert "<b>torch-ddp</b>: no timeline — it reports no per-bucket backward stats" in section


def test_terminal_summary_says_each_cause_and_why_a_run_ended_early():
    crashed = case_record("torch-ddp", SCENARIO, verdict="failed", message="...", duration_s=1.0, failure=Classified(
        FailureClass.CRASHED, "rank 1: process exited with signal SIGSEGV while running x; log: Fatal Python error: Segmentation fault"))
    out = io.StringIO()
    terminal.render(Console(file=out, width=300), [crashed, _records()[0]], None, [], stopped="interrupted: KeyboardInterrupt")
    text = out.getvalue()
    assert "✗ torch-ddp|ddp/plain/mlp/w2/fp32: [crashed] rank 1: process exited with signal SIGSEGV" in text
    assert "log: Fatal Python error: Segmentation fault" in text
    assert "the run ended early: interrupted: KeyboardInterrupt" in text
    out = io.StringIO()
    terminal.render(Console(file=out, width=300), [_records()[0]], None, [], stopped="stopping after 1 failures")
    assert "incomplete" in out.getvalue() and "conformant" not in out.getvalue()


INTERMITTENT = "ends-world: intermittent: gloo aborts in some runs (x/y#7)"


def _intermittent_records() -> list[dict]:
    passed = case_record("torch-ddp", SCENARIO, verdict="passed", message="passed this run; ...", duration_s=0.1,
                         xfail_reason=INTERMITTENT)
    crashed = case_record("refimpl-ddp", SCENARIO, verdict="xfailed", message="...", duration_s=0.1,
                          failure=Classified(FailureClass.CRASHED, "rank 1: process exited with signal SIGABRT"),
                          xfail_reason=INTERMITTENT)
    return [passed, crashed]


def test_terminal_summary_says_which_outcome_an_intermittent_expected_failure_had():
    out = io.StringIO()
    terminal.render(Console(file=out, width=400), _intermittent_records(), None, [])
    text = out.getvalue()
    assert ("~ torch-ddp|ddp/plain/mlp/w2/fp32: known intermittent failure did not happen this run: passed "
            "(every value judged right); listed: " + INTERMITTENT) in text
    assert ("~ refimpl-ddp|ddp/plain/mlp/w2/fp32: known intermittent failure happened this run: xfailed "
            "([crashed] rank 1: process exited with signal SIGABRT)") in text
    assert "NOT CONFORMANT" not in text and "✗" not in text  # neither outcome fails the run
    out = io.StringIO()
    terminal.render(Console(file=out, width=400), _records(), None, [])
    assert "~ " not in out.getvalue()  # strict entries and plain passes get no such line


def test_a_pass_of_an_intermittent_expected_failure_is_footnoted_in_the_html():
    page = html.render(_report(_intermittent_records()))
    notes = re.search(r'<ol class="reasons">(.*?)</ol>', page).group(1)
    assert "known intermittent failure did not happen this run: passed" in notes and "issues/7" in notes


def test_a_case_whose_process_died_is_recorded_as_an_error_not_lost():
    nodeid = "conformance/suite/test_ddp.py::test_ddp[torch-ddp|ddp/plain/mlp/w2/fp32]"
    lost = lost_case_record(nodeid, "worker 'gw0' crashed while running '...'")
    assert lost["verdict"] == "error" and lost["failure_class"] == "infrastructure"
    assert lost["cause"] == "no result: the process running this case died (worker 'gw0' crashed while running '...')"
    assert lost_case_record(nodeid, "x", known={"torch-ddp|ddp/plain/mlp/w2/fp32"}) is None  # a teardown failure
    assert lost_case_record("tests/test_x.py::test_y", "x") is None
    # a --device cuda run names its cases <scenario>/cuda: they are not lost either
    on_gpu = lost_case_record(nodeid.replace("fp32]", "fp32/cuda]"), "worker 'gw1' crashed")
    assert on_gpu["case"] == "torch-ddp|ddp/plain/mlp/w2/fp32/cuda" and on_gpu["device"] == "cuda"
    assert on_gpu["verdict"] == "error"
    assert lost_case_record(nodeid.replace("fp32]", "fp32/tpu]"), "x") is None  # not a device the suite runs on


def test_xfailed_record_in_the_failures_of_a_strict_pass():
    xpassed = case_record("torch-ddp", SCENARIO, verdict="xpassed", message="[XPASS(strict)] r", duration_s=0.1,
                          xfail_reason=REASON)
    page = html.render(_report([xpassed]))
    assert "listed as an expected failure:</b> zeros instead of None" in page
    assert SEEN not in page


def test_no_false_claim_about_an_adapter_whose_cases_all_failed():
    section = timeline.section(_report([_records()[1]]))  # refimpl-ddp: one failed case, no stats
    assert "none of its cases passed" in section and "reports no per-bucket" not in section


def test_a_run_that_ended_early_says_so_at_the_top_of_the_page():
    report = build_report(_records(), adapters=["torch-ddp"], profile="quick",
                          run_info={"stopped": "stopping after 1 failures; 3 of 8 selected cases have no result"})
    page = html.render(report)
    assert "ended early" in page and "3 of 8 selected cases have no result" in page
    assert "ended early" not in html.render(_report())


def test_rank_zeros_stats_alone_are_drawn_too():
    record = dict(case_record("refimpl-ddp", SCENARIO, verdict="passed", message="", duration_s=0.1),
                  details={"backward_stats": STATS})  # the zoo's records keep rank 0's stats only
    assert timeline.stats_of(record) is STATS and timeline.section(_report([record])).count("<svg") == 1


def test_a_figure_stays_compact_when_a_case_has_many_buckets():
    many = {"buckets": [dict(STATS["buckets"][0], index=i) for i in range(40)], "backward_end_ns": 5_000_000}
    base = case_record("refimpl-ddp", SCENARIO, verdict="passed", message="", duration_s=0.1)
    tall = dict(base, details={"backward_stats": {"0": many}})
    section = timeline.section(_report([tall]))
    assert "40 bucket(s), the first 24 drawn" in section and section.count("<rect") == 2 * 24
    fits = dict(base, case="refimpl-ddp|b", scenario="ddp/b/mlp/w2/fp32", details={"backward_stats": {"0": STATS}})
    assert "ddp/b/mlp/w2/fp32</code>" in timeline.section(_report([tall, fits]))  # one that fits wins


def test_a_case_whose_worker_died_reaches_the_results_through_the_plugin():
    """xdist reports a crashed worker's case with no gradparity record: the session records it."""
    from types import SimpleNamespace

    from conformance.frontends.plugin import Session
    from conformance.plan import Selection

    session = Session(config=None, selection=Selection(adapters=("torch-ddp",)))
    nodeid = "conformance/suite/test_ddp.py::test_ddp[torch-ddp|ddp/plain/mlp/w2/fp32]"
    session.pytest_runtest_logreport(SimpleNamespace(user_properties=[], failed=True, nodeid=nodeid,
                                                     longrepr="worker 'gw1' crashed while running it"))
    (record,) = session.results
    assert record["verdict"] == "error" and "worker 'gw1' crashed" in record["cause"]
    session.pytest_keyboard_interrupt(SimpleNamespace(typename="KeyboardInterrupt", value=""))
    assert session.stopped == "interrupted: KeyboardInterrupt"
