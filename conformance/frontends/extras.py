"""What the suite needs beyond torch, checked before a front end imports it.

gradparity is one distribution with two audiences: a trainer who only imports `refimpl` installs
`pip install gradparity` and gets torch and nothing else; the suite's own dependencies come with
the `suite` extra (`pip install "gradparity[suite]"`). So the suite's front ends (the
`gradparity` command, the pytest plugin) can find themselves installed without what they
import. They ask here first and stop with one line naming what to install, never a traceback.

The pytest plugin's entry point (`conformance.frontends.pytest_entry`) asks too, and loads nothing when
the suite is not installed: an unrelated `pytest` run in an environment that has gradparity for
refimpl only must not break because the entry point is loaded.

This module imports the standard library only.
"""

from __future__ import annotations

import importlib.util
import sys

# import name -> the distribution that provides it (what `pip install` takes)
SUITE = {"pytest": "pytest", "xdist": "pytest-xdist", "rich": "rich", "numpy": "numpy"}
INSTALL = "pip install \"gradparity[suite]\" (with -c constraints.txt from a checkout, to keep torch pinned)"


class SuiteNotInstalled(ImportError):
    """A suite front end imported without the `suite` extra; the message is one line."""


def missing() -> list[str]:
    """The suite's distributions that cannot be imported here (none when the extra is installed)."""
    return [dist for name, dist in SUITE.items() if importlib.util.find_spec(name) is None]


def message(what: str, absent: list[str]) -> str:
    return f"{what} needs {', '.join(absent)}, not installed: {INSTALL}"


def require(what: str) -> None:
    """Raise SuiteNotInstalled (one line: what is missing and the command) unless the suite is installed."""
    absent = missing()
    if absent:
        raise SuiteNotInstalled(message(what, absent))


def main() -> int:
    """The `gradparity` console script: the check first, then the command line (conformance.frontends.cli)."""
    absent = missing()
    if absent:
        print(f"gradparity: error: {message('the gradparity command', absent)}", file=sys.stderr)
        return 2
    from conformance.frontends.cli import main as cli_main

    return cli_main()
