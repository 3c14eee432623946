"""The plugin says why wherever pytest runs from (#40): run from a temporary directory outside
the repository (no pyproject, so no `-ra`), the skip and xfail reasons are printed by the plugin
itself, an all-skipped run is `nothing checked` with exit 2 (`gradparity run`) or 5 (plain
pytest: no test was shown to conform), and an expected failure's class is labelled as expected."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance import catalogue

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_an_all_skipped_run_prints_its_reasons_and_is_not_a_pass(tmp_path):
    plain = _run(["-m", "pytest", "--pyargs", "conformance.suite", "--adapter", "torch-data-parallel",
                  "--gradparity-report-dir", str(tmp_path / "r1"), "-p", "no:cacheprovider"], tmp_path)
    out = plain.stdout
    assert plain.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, out[-2000:]
    quick = len(catalogue.select(area="data_parallel", profile="quick"))  # every one skipped: CUDA only
    assert f"torch-data-parallel: {quick} skipped: " in out and "short test summary info" not in out  # no -ra here
    assert f"torch-data-parallel: nothing checked: all {quick} case(s) skipped" in out
    assert "exit status 2: nothing checked: every case of the run was skipped" in out
    command = _run(["-c", "import sys; from conformance.frontends.cli import main; sys.exit(main())", "run", "--adapter",
                    "torch-data-parallel", "--report-dir", str(tmp_path / "r2")], tmp_path)
    assert command.returncode == 2
    assert command.stderr.strip().splitlines()[-1].startswith(
        f"gradparity: error: nothing checked: every case of the run was skipped ({quick}: ")


@pytest.mark.slow
def test_an_expected_failure_prints_its_reason_and_its_class_as_expected(tmp_path):
    done = _run(["-c", "import sys; from conformance.frontends.cli import main; sys.exit(main())", "run", "--adapter", "torch-ddp",
                 "--scenario", "ddp/buffer-order/buffer-order/w2/fp32", "--report-dir", str(tmp_path / "r")], tmp_path)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-2000:]
    assert ("x torch-ddp|ddp/buffer-order/buffer-order/w2/fp32: [expected wrong value] expected failure: "
            "positional buffer broadcast" in " ".join(out.split()))
    assert "expected failures' classes (not failures of this run): wrong value 1" in out
