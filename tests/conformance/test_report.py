"""The report writers fed hand-built case records: one run per directory, provenance, JUnit, HTML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from conformance import catalogue
from conformance.judge.failure import Classified, FailureClass
from conformance.report import RUN_FILES, start_run, write_reports
from conformance.report import run_info as provenance
from conformance.report.junit import write_junit
from conformance.report.record import case_record

SCENARIO = next(s for s in catalogue.all_scenarios() if s.id == "ddp/plain/mlp/w2/fp32")
SEEN = "[ddp/plain/mlp/w2/fp32] rank 1, step 0, grad of 'fc1.weight': max abs error 0.5"
REASON = "zeros instead of None (pytorch/pytorch#40566)"


def _records() -> list[dict]:
    wrong = Classified(FailureClass.WRONG_VALUE, "rank 1, step 0: grad of 'fc1.weight' differs")
    return [
        case_record("torch-ddp", SCENARIO, verdict="passed", message="", duration_s=0.5),
        case_record("refimpl-ddp", SCENARIO, verdict="failed", message=SEEN, duration_s=0.25, failure=wrong),
        case_record("ddp-class=torch.nn.parallel:DistributedDataParallel", SCENARIO, verdict="xfailed", message=SEEN,
                    duration_s=0.25, failure=wrong, xfail_reason=REASON),
        case_record("refimpl-sharded", SCENARIO, verdict="skipped", message="refimpl-sharded lacks capability: no_sync",
                    duration_s=0.0),
        case_record("torch-fsdp", SCENARIO, verdict="error", message="pool would not start", duration_s=1.0,
                    failure=Classified(FailureClass.INFRASTRUCTURE, "rank 0: could not start ranks")),
    ]


ADAPTERS = ["torch-ddp", "refimpl-ddp", "ddp-class=torch.nn.parallel:DistributedDataParallel"]


def test_the_xfailed_record_keeps_the_error_seen_and_the_reason_apart():
    xfailed = _records()[2]
    assert xfailed["message"] == SEEN and xfailed["xfail_reason"] == REASON
    assert xfailed["failure_class"] == "wrong value"


def test_a_report_dir_holds_one_run_and_only_the_suites_files_are_removed(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / "zoo.json").write_text("{}")
    for name in RUN_FILES:
        (tmp_path / name).write_text("stale: the previous run")
    removed = start_run(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == sorted(RUN_FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "zoo"]
    assert (tmp_path / "zoo" / "zoo.json").exists()
    paths = write_reports(str(tmp_path), _records(), adapters=ADAPTERS, profile="quick")
    assert sorted(os.path.basename(p) for p in paths.values()) == sorted(RUN_FILES)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # every file renamed into place
    for name in RUN_FILES:
        assert "stale" not in (tmp_path / name).read_text()


def test_json_carries_the_command_commit_and_adapter_versions(tmp_path):
    import torch

    info = provenance.collect(profile="quick", adapters=ADAPTERS, argv=["gradparity", "run", "--profile", "quick"])
    paths = write_reports(str(tmp_path), _records(), adapters=ADAPTERS, profile="quick", run_info=info)
    report = json.loads(open(paths["json"]).read())
    assert report["schema"] == "gradparity.report/3"
    assert report["run"]["command"] == "gradparity run --profile quick"
    assert report["suite"]["commit"] == provenance.suite_provenance()["commit"]
    versions = {a["spec"]: a["version"] for a in report["adapters"]}
    assert versions["torch-ddp"] == torch.__version__
    # --ddp-class: the version of the distribution that ships the class's top-level package
    assert versions["ddp-class=torch.nn.parallel:DistributedDataParallel"] == provenance.distribution_version("torch")
    (xfailed,) = [r for r in report["results"] if r["verdict"] == "xfailed"]
    assert xfailed["message"] == SEEN and xfailed["xfail_reason"] == REASON
    assert report["run_info"]["backend"] == "gloo" and report["run_info"]["device"] == "cpu"


def test_the_commit_is_this_checkouts_head_when_the_suite_runs_from_a_clone():
    import conformance

    root = os.path.dirname(os.path.dirname(os.path.abspath(conformance.__file__)))
    if not os.path.exists(os.path.join(root, ".git")):
        pytest.skip("the suite is not installed from a git checkout here")
    head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert provenance.suite_provenance()["commit"] == head
    assert provenance.suite_provenance()["commit_source"] == "git checkout"


def test_no_commit_outside_a_checkout_and_never_an_enclosing_repos(tmp_path, monkeypatch):
    """A package inside some other repository (a venv in a user's project) must not report that repo's HEAD."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    pkg = tmp_path / "venv" / "site-packages"
    pkg.mkdir(parents=True)
    assert provenance._git_commit(str(pkg)) is None
    assert provenance._git_commit(str(tmp_path / "nowhere")) is None


def test_ddp_class_version_is_its_distributions_even_when_the_import_name_differs():
    from importlib.metadata import version
    from types import SimpleNamespace

    adapter = SimpleNamespace(cls=type("MyDDP", (), {}), version="unknown")
    # import name `xdist`, distribution `pytest-xdist`
    assert provenance.adapter_version("ddp-class=xdist.plugin:MyDDP", adapter) == version("pytest-xdist")


def test_unknown_ddp_class_package_version_is_unknown_not_a_crash():
    from types import SimpleNamespace

    adapter = SimpleNamespace(cls=type("MyDDP", (), {}), version="unknown")
    assert provenance.adapter_version("ddp-class=no_such_pkg_gp.mod:MyDDP", adapter) == "unknown"
    declared = SimpleNamespace(cls=type("MyDDP", (), {"__version__": "3.1"}), version="unknown")
    assert provenance.adapter_version("ddp-class=no_such_pkg_gp.mod:MyDDP", declared) == "3.1"


def test_command_line_names_the_module_of_a_dash_m_run(tmp_path):
    (tmp_path / "gp_probe_mod.py").write_text("from conformance.report.run_info import command_line\nprint(command_line())\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    out = subprocess.run([sys.executable, "-m", "gp_probe_mod", "--a", "b c"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "python -m gp_probe_mod --a 'b c'"
    assert provenance.command_line(["gradparity", "run", "-k", "a b"]) == "gradparity run -k 'a b'"


def test_junit_suite_properties_and_verdicts(tmp_path):
    info = provenance.collect(profile="quick", backend="gloo", device="cpu", adapters=ADAPTERS, argv=["gradparity", "run"])
    path = write_junit(str(tmp_path / "junit.xml"), _records(), info)
    root = ET.parse(path).getroot()
    (suite,) = root.findall("testsuite")
    assert suite.get("name") == "gradparity" and root.get("name") == "gradparity"
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("5", "1", "1", "2")
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["torch"] == info["torch"] and props["backend"] == "gloo" and props["device"] == "cpu"
    assert props["profile"] == "quick" and props["command"] == "gradparity run"
    assert props["adapters"] == ", ".join(ADAPTERS)
    if info["commit"]:
        assert props["commit"] == info["commit"]
    cases = {c.get("classname"): c for c in suite.findall("testcase")}
    failed = cases["gradparity.ddp.refimpl-ddp"].find("failure")
    assert failed.get("type") == "wrong value" and failed.get("message").startswith("[wrong value] rank 1")
    assert failed.text == SEEN
    xfailed = cases["gradparity.ddp.ddp-class=torch.nn.parallel:DistributedDataParallel"].find("skipped")
    assert xfailed.get("type") == "xfail" and REASON in xfailed.get("message") and SEEN in xfailed.text
    assert cases["gradparity.ddp.torch-fsdp"].find("error").get("type") == "infrastructure"
    assert "lacks capability" in cases["gradparity.ddp.refimpl-sharded"].find("skipped").get("message")
    assert list(cases["gradparity.ddp.torch-ddp"]) == []  # a pass has no child


def test_junit_says_which_outcome_an_intermittent_expected_failure_had(tmp_path):
    reason = "ends-world: intermittent: gloo aborts in some runs (x/y#7)"
    passed = case_record("torch-ddp", SCENARIO, verdict="passed", message="passed this run", duration_s=0.1,
                         xfail_reason=reason)
    root = ET.parse(write_junit(str(tmp_path / "junit.xml"), [passed], {"adapters": ["torch-ddp"]})).getroot()
    (case,) = root.iter("testcase")
    assert case.find("failure") is None and case.find("skipped") is None  # a pass, in JUnit's words too
    out = case.find("system-out").text
    assert out.startswith("known intermittent failure did not happen this run: passed") and reason in out


def test_junit_survives_control_characters_from_rank_logs(tmp_path):
    record = case_record("torch-ddp", SCENARIO, verdict="failed", message="log:\x1b[31mred\x00", duration_s=0.0,
                         failure=Classified(FailureClass.CRASHED, "rank 1: signal SIGSEGV"))
    path = write_junit(str(tmp_path / "junit.xml"), [record], {"adapters": ["torch-ddp"]})
    assert "\\x1b[31mred\\x00" in ET.parse(path).getroot().find("testsuite/testcase/failure").text


def test_one_profile_for_the_whole_document_whoever_names_it(tmp_path):
    from conformance.report.json_report import build_report

    info = provenance.collect(profile="standard", adapters=ADAPTERS)
    # a front end that passes its run_info (with the profile) but no `profile=`: not the default "quick"
    report = build_report(_records(), adapters=ADAPTERS, run_info=info)
    assert report["run"]["profile"] == report["run_info"]["profile"] == "standard"
    # the explicit argument wins, and run_info says the same
    report = build_report(_records(), adapters=ADAPTERS, profile="full", run_info=info)
    assert report["run"]["profile"] == report["run_info"]["profile"] == "full"


def test_reports_are_utf8_whatever_the_locale(tmp_path):
    """The HTML says charset utf-8 and holds ✓ ◆ µs: an ASCII locale must not fail the write."""
    env = dict(os.environ, PYTHONUTF8="0", PYTHONCOERCECLOCALE="0", LC_ALL="C", LANG="C")
    script = (
        "import sys, locale; from tests.conformance.test_report import _records, ADAPTERS;"
        "from conformance.report import write_reports;"
        "print(locale.getpreferredencoding(False));"
        "write_reports(sys.argv[1], _records(), adapters=ADAPTERS, profile='quick')"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, cwd=root, capture_output=True,
                          text=True, encoding="utf-8", errors="replace", check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "✓" in (tmp_path / "gradparity.html").read_text(encoding="utf-8")
    json.loads((tmp_path / "gradparity.json").read_text(encoding="utf-8"))
