"""The suite's extra (conformance/frontends/extras.py): refimpl-only installs get one line, never a traceback."""

import fnmatch
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import conformance.frontends.extras as extras
import conformance.frontends.pytest_entry as pytest_entry


def _without(monkeypatch, module="no_such_suite_dependency", dist="no-such-dist"):
    monkeypatch.setitem(extras.SUITE, module, dist)


def test_nothing_missing_where_the_suite_is_installed():
    assert extras.missing() == []
    extras.require("the suite")  # does not raise


def test_a_missing_dependency_is_named_with_the_command_in_one_line(monkeypatch):
    _without(monkeypatch)
    assert extras.missing() == ["no-such-dist"]
    try:
        extras.require("the gradparity pytest plugin")
    except extras.SuiteNotInstalled as exc:
        text = str(exc)
    else:
        raise AssertionError("require() passed with a dependency missing")
    assert "\n" not in text and "no-such-dist" in text and 'pip install "gradparity[suite]"' in text
    assert isinstance(extras.SuiteNotInstalled(text), ImportError)


def test_the_command_stops_with_exit_2_and_one_line(monkeypatch, capsys):
    _without(monkeypatch)
    assert extras.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gradparity: error: the gradparity command needs no-such-dist")


def test_the_entry_point_loads_the_plugin_only_with_the_suite(monkeypatch):
    try:
        assert pytest_entry.pytest_plugins == ["conformance.frontends.plugin"]
        _without(monkeypatch)
        importlib.reload(pytest_entry)
        assert pytest_entry.pytest_plugins == []  # an empty plugin: other pytest runs are untouched
    finally:
        monkeypatch.undo()
        importlib.reload(pytest_entry)


def test_the_pyproject_keeps_refimpl_torch_only():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert [d.split(">")[0].split("=")[0] for d in project["dependencies"]] == ["torch"]
    assert {d.split(">")[0] for d in project["optional-dependencies"]["suite"]} == set(extras.SUITE.values())
    assert project["entry-points"]["pytest11"]["gradparity"] == "conformance.frontends.pytest_entry"
    assert project["scripts"]["gradparity"] == "conformance.frontends.extras:main"


def test_every_data_file_of_the_packages_is_packaged():
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = [p for pkg in ("conformance", "refimpl") for p in (root / pkg).rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    unpackaged = [str(p.relative_to(root)) for p in data
                  if not any(fnmatch.fnmatch(str(p.relative_to(root / p.relative_to(root).parts[0])), g)
                             for g in globs.get(p.relative_to(root).parts[0], []))]
    assert data and not unpackaged, f"data files a wheel would leave out (pyproject package-data): {unpackaged}"


def test_refimpl_imports_nothing_of_the_suite_s_dependencies(tmp_path):
    code = ("import sys, refimpl, refimpl.ddp, refimpl.sharded, refimpl.data_parallel, refimpl.distributed_autograd; "
            "print(sorted(m for m in ('pytest', 'xdist', 'rich', 'conformance') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert out.stdout.strip() == "[]"
