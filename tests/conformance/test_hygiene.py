"""After a run that had a crash and a hang, nothing is left behind: no rank process, no temp
dir, no shared-memory segment of the run's processes."""

import multiprocessing
import os
import tempfile

import pytest

from conformance.harness.pool import PoolManager
from conformance.topology import choose_topology

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hygiene")]
PROBE = "conformance.harness.probes:"


def _alive(pid: int) -> bool:
    """Running, or a zombie nobody reaped (both count as left behind)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _shm_of(pids) -> list[str]:
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return [n for n in names if any(str(p) in n for p in pids)]


def test_nothing_is_left_after_a_crash_a_hang_and_close():
    before_children = {p.pid for p in multiprocessing.active_children()}
    pools = PoolManager()
    pool = pools.get(choose_topology(2, "cpu"))
    pids, workdirs, kinds = set(), [], []
    for fn, payload, timeout in (("echo", 0, 60), ("exit_on", 1, 60), ("echo", 1, 60), ("hang_on", 1, 3), ("echo", 2, 60)):
        outcome = pool.run(PROBE + fn, payload, timeout=timeout)
        if pool.workdir:  # after each echo the world is up: note its processes and its temp dir
            workdirs.append(pool.workdir)
            pids.update(pool.pids)
        kinds.append(sorted({f.kind for f in outcome.failures.values()}))
    assert kinds[1][0] == "died" and "timeout" in kinds[3] and kinds[4] == [], kinds  # the run had a crash and a hang
    assert pool.startups == 3
    pools.close()

    assert len(pids) == 6, pids  # three worlds of two ranks
    left = [pid for pid in pids if _alive(pid)]
    assert not left, f"rank processes left behind: {left}"
    assert {p.pid for p in multiprocessing.active_children()} <= before_children
    stale = [d for d in set(workdirs) if os.path.exists(d)]
    assert workdirs and not stale, f"temp dirs left behind: {stale}"
    assert all(d.startswith(tempfile.gettempdir()) for d in workdirs)
    assert not _shm_of(pids), f"shared-memory segments left behind: {_shm_of(pids)}"
