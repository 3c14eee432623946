"""The gradient channel under churn and load (channel_stress.py): no byte of it ever reaches
another protocol's stream, where TensorPipe or gloo would read it as a length (issue 40's
``std::bad_alloc``). ``REFIMPL_CHANNEL_STRESS_RUNS=200`` runs it 200 times (about 3 s each)."""

from __future__ import annotations

import os
import warnings

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
