"""The gradient channel under churn and load (channel_stress.py): no byte of it ever reaches
another protocol's stream, where TensorPipe or gloo would read it as a length (issue 40's
``std::bad_alloc``). ``REFIMPL_CHANNEL_STRESS_RUNS=200`` runs it 200 times (about 3 s each);
and the engine under load (engine_stress.py, slow: a warm RPC world and two spinning processes;
``REFIMPL_ENGINE_STRESS_ROUNDS`` contexts per thread)."""

from __future__ import annotations

import os
import warnings

import pytest

from tests.refimpl.distributed_autograd.channel_stress import run_once


def test_channel_bytes_never_reach_another_protocols_stream():
    runs = int(os.environ.get("REFIMPL_CHANNEL_STRESS_RUNS", "1"))
    failed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peers replaced under their callers: expected warnings
        for seed in range(runs):
            out = run_once(seed)
            assert out["replaced"], "the run replaced no channel: nothing was stressed"
            if out["victim_bytes"]:
                failed.append(f"run {seed}: {out['victim_bytes'][0]}")
    assert not failed, f"{len(failed)} of {runs} runs wrote channel bytes into a foreign listener: {failed[:3]}"


def _spin(seconds: float) -> None:
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(10_000))


@pytest.mark.slow
def test_many_short_contexts_with_empty_gradients_on_a_busy_machine(rpc_world):
    """engine_stress.py: 4 threads x ``REFIMPL_ENGINE_STRESS_ROUNDS`` contexts on worker 0
    while two processes spin; every worker survives and every context is right."""
    import multiprocessing

    from tests.refimpl.distributed_autograd import engine_stress

    ctx = multiprocessing.get_context("spawn")
    hogs = [ctx.Process(target=_spin, args=(600.0,), daemon=True) for _ in range(2)]
    for hog in hogs:
        hog.start()
    try:
        rpc_world.run(engine_stress.check, timeout_s=300.0)
    finally:
        for hog in hogs:
            hog.kill()
            hog.join(5)
