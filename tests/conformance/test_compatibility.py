"""The compatibility matrix and docs/compatibility.md generator, on a hand-built report."""

from __future__ import annotations

from conformance.report import compatibility, matrix


def _result(adapter, scenario, verdict, message=""):
    return {"adapter": adapter, "scenario": scenario, "verdict": verdict, "message": message}


REPORT = {
    "created": "2026-01-01T00:00:00+00:00",
    "environment": {"torch": "2.13.0+cpu", "python": "3.11", "platform": "linux"},
    "adapters": [
        {"spec": "eng-a", "version": "1.0", "semantics": ["buffers: never (torch DDP: rank0-before-forward)"],
         "semantics_sources": ["eng-a docs, buffers"]},
        {"spec": "eng-b", "version": "2.0", "semantics": [], "semantics_sources": []},
    ],
    "results": [
        _result("eng-a", "ddp/plain/mlp/w2/fp32", "passed"),
        _result("eng-a", "ddp/unused-on-all/branches/w2/fp32", "xfailed", "zeros instead of None (x/y#1)"),
        _result("eng-a", "ddp/unused-on-rank1/branches/w2/fp32", "xfailed", "zeros instead of None (x/y#1)"),
        _result("eng-b", "ddp/plain/mlp/w2/fp32", "failed", "[ddp/plain/mlp/w2/fp32] wrong\n  details"),
        _result("eng-b", "ddp/long/mlp/w2/fp32", "skipped", "lacks capability"),
    ],
}


def test_groups_come_from_the_scenario_name():
    assert matrix.group_of("ddp/plain/mlp/w2/fp32") == "basics"
    assert matrix.group_of("ddp/skew-step/mlp/w2/fp32") == "training loop"
    assert matrix.group_of("ddp/unknown-thing/mlp/w2/fp32") == "other"


def test_the_page_has_the_matrix_wall_times_and_one_line_per_finding():
    text = compatibility.render([REPORT], {"command": "gradparity run ...", "wall_s": {"eng-a": 12.4}})
    assert "| engine | basics | unused params | training loop | total | wall time |" in text
    assert "| eng-a | 1✓ | 0✓ 2x | n/a | 1 passed, 2 xfailed | 12 s |" in text
    assert "| eng-b | 0✓ 1✗ | n/a | 0✓ 1– | 1 failed, 1 skipped | - |" in text
    findings = [line for line in text.splitlines() if line.startswith("- **")]
    assert sum("zeros instead of None" in line for line in findings) == 1  # two cases, one finding
    assert any("UNEXPECTED FAILURE" in line and "eng-b" in line for line in findings)
    assert any("declared: buffers: never" in line and "eng-a docs" in line for line in findings)
    assert "Not runnable on CPU here" in text and "Horovod" in text


def test_an_expected_failure_is_listed_by_its_reason_not_the_error_seen():
    """Schema 3 keeps the error seen in `message` and the xfail entry's reason in `xfail_reason`."""
    report = dict(REPORT, results=[
        dict(_result("eng-a", "ddp/unused-on-all/branches/w2/fp32", "xfailed", "[ddp/unused-on-all] rank 0: grads differ"),
             xfail_reason="zeros instead of None (x/y#1)"),
    ])
    findings = [line for line in compatibility.render([report]).splitlines() if line.startswith("- **eng-a** — expected")]
    assert findings == ["- **eng-a** — expected failure: zeros instead of None (x/y#1) (1 case: `ddp/unused-on-all/branches/w2/fp32`)"]
