"""Expected failures and skips: per-implementer files of case or node ids with `#` reasons.

Built-in adapters ship theirs in conformance/adapters/xfails/<adapter name>.txt, each entry
naming the upstream issue, so a known upstream bug is recorded rather than hidden. Entries are
strict expected failures unless their reason is marked `intermittent:` (below).

[Note: expectations on every device]
An entry names a scenario by its id as the catalogue writes it (`adapter|ddp/x/mlp/w2/fp32`) and
matches that scenario on every device: under `--device cuda` the case is `…/fp32/cuda`, and
the entry still applies. An entry ending in a device (`…/fp32/cuda`, `…/fp32/cpu`) applies on
that device only: a failure whose cause is the CPU/gloo path (torch DDP's mixed precision needs
CUDA events) is listed `/cpu`, one seen only on GPUs `/cuda`.
On CUDA, an `ends-world:` entry (a rank aborts or hangs) becomes a skip (`CUDA_ENDS_WORLD`):
gloo checks sizes and aborts a rank, NCCL does not and hangs until the task's budget and the
pool are spent. Those are the only differences between a CPU plan and a CUDA plan
(tests/conformance/test_plan_devices.py).
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


DEVICES = ("cpu", "cuda")
# The skip reason an ends-world entry gets on CUDA ([Note: expectations on every device]).
CUDA_ENDS_WORLD = "skipped on CUDA: this case ends the world, and NCCL hangs where gloo aborts: {reason}"


def split_device(scenario_id: str) -> tuple[str, str | None]:
    """`ddp/x/w2/fp32/cuda` -> (`ddp/x/w2/fp32`, "cuda"); an id without a device -> (id, None)."""
    base, _, last = scenario_id.rpartition("/")
    return (base, last) if base and last in DEVICES else (scenario_id, None)


def on_device_reason(reason: str, device: str) -> tuple[str, str | None]:
    """(skip, xfail) for an xfail entry's `reason` on `device`: on CUDA an ends-world failure is
    a skip that says why ([Note: expectations on every device]); elsewhere the entry as it is."""
    if device == "cuda" and ends_world(reason):
        return CUDA_ENDS_WORLD.format(reason=reason), None
    return "", reason


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
