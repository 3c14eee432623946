"""Expected failures and skips: per-implementer files of case or node ids with `#` reasons.

Built-in adapters ship theirs in conformance/adapters/xfails/<adapter name>.txt, each entry
naming the upstream issue, so a known upstream bug is recorded rather than hidden.
"""

from __future__ import annotations

import os

XFAILS_DIR = os.path.join(os.path.dirname(__file__), "adapters", "xfails")

# A reason that starts with this marker says the failure takes the world with it (a rank aborts
# or hangs). The warm pool respawns a world, so `gradparity run` runs such a case; a torchrun
# world cannot be respawned, so the torchrun launcher skips it and says why.
ENDS_WORLD = "ends-world:"


def ends_world(reason: str | None) -> bool:
    return bool(reason) and reason.lstrip().startswith(ENDS_WORLD)


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
