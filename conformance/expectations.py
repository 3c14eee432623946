"""Expected failures and skips: per-implementer files of case or node ids with `#` reasons.

Built-in adapters ship theirs in conformance/adapters/xfails/<adapter name>.txt, each entry
naming the upstream issue, so a known upstream bug is recorded rather than hidden. Entries are
strict expected failures unless their reason is marked `intermittent:` (below).
"""

from __future__ import annotations

import os

XFAILS_DIR = os.path.join(os.path.dirname(__file__), "adapters", "xfails")

# A reason starts with zero or more markers, in any order (`ends-world: intermittent: why`).
#
# ENDS_WORLD says the failure takes the world with it (a rank aborts or hangs). The warm pool
# respawns a world, so `gradparity run` runs such a case; a torchrun world cannot be respawned, so
# the torchrun launcher skips it and says why.
ENDS_WORLD = "ends-world:"
# INTERMITTENT says the listed failure shows in some runs only (a race inside the implementation
# under test). Such an entry is not strict: the case runs and is judged as every case is; failing
# is `xfailed` as for any entry, passing is `passed` (every value was judged right) with the entry's
# reason kept in the record's `xfail_reason` and the outcome said by the terminal summary, the
# JUnit and HTML reports (`conformance.report.record.intermittent_outcome`), never an XPASS and
# never a silent pass. An unmarked entry stays strict: a listed case that passes fails the run.
INTERMITTENT = "intermittent:"
MARKERS = (ENDS_WORLD, INTERMITTENT)


def markers(reason: str | None) -> frozenset[str]:
    """The markers a reason starts with, in any order; the rest of the reason says why."""
    found, rest = set(), (reason or "").lstrip()
    while True:
        marker = next((m for m in MARKERS if rest.startswith(m)), None)
        if marker is None:
            return frozenset(found)
        found.add(marker)
        rest = rest[len(marker):].lstrip()


def ends_world(reason: str | None) -> bool:
    return ENDS_WORLD in markers(reason)


def intermittent(reason: str | None) -> bool:
    return INTERMITTENT in markers(reason)


def read_expectations(path: str) -> dict[str, str]:
    """`id  # reason` lines; blank lines and full-line comments are ignored."""
    out = {}
    with open(path) as fh:
        for line in fh:
            entry, _, reason = line.partition("#")
            entry = entry.strip()
            if entry:
                out[entry] = reason.strip() or "listed in " + os.path.basename(path)
    return out


def builtin_xfails(adapter_name: str) -> str | None:
    path = os.path.join(XFAILS_DIR, f"{adapter_name}.txt")
    return path if os.path.exists(path) else None
