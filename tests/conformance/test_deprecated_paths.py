"""The suite's moved module paths (#41): each old path still imports for one minor version, warns
with the new path, and gives the new module's names; CHANGELOG.md's table lists exactly them; the
entry points name the new modules."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance import _deprecated
from tests.deprecated_paths import assert_moved_path_works

ROOT = Path(__file__).resolve().parents[2]


def _changelog_moves() -> dict[str, str]:
    """The `| old | new |` rows of CHANGELOG.md's table of moved conformance modules."""
    rows = re.findall(r"^ *\| `(conformance\.[\w.]+)` \| `(conformance\.[\w.]+)` \|", (ROOT / "CHANGELOG.md").read_text(), re.M)
    return dict(rows)


def test_the_changelog_lists_every_moved_path():
    assert _changelog_moves() == _deprecated.MOVED


@pytest.mark.parametrize("old", sorted(_deprecated.MOVED))
def test_a_moved_path_warns_and_gives_the_new_names(old):
    assert_moved_path_works(old, _deprecated.MOVED, _deprecated.REMOVED_IN)


def test_the_old_cli_path_still_runs_as_a_module():
    done = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "conformance.cli", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: gradparity" in done.stdout and "conformance.frontends.cli" in done.stderr


def test_the_entry_points_name_the_new_modules():
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib needs Python 3.11; the project supports 3.10)
    script = text.split("[project.scripts]", 1)[1].split("[", 1)[0]
    plugin = text.split("[project.entry-points.pytest11]", 1)[1].split("[", 1)[0]
    # The suite's dependency check first (the `suite` extra, #40), then conformance.frontends.cli / .plugin.
    assert script.strip() == 'gradparity = "conformance.frontends.extras:main"'
    assert plugin.strip() == 'gradparity = "conformance.frontends.pytest_entry"'
    assert callable(importlib.import_module("conformance.frontends.cli").main)
    assert importlib.import_module("conformance.frontends.pytest_entry").pytest_plugins == ["conformance.frontends.plugin"]
