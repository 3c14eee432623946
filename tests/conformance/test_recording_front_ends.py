"""`--record` through every front end and every area: `gradparity run` (pytest, warm pools),
the torchrun launcher and the zoo's runner all hand their recorder to the one case pipeline, so
the same case recorded by two front ends compares bitwise (2 ranks, exact data)."""

import subprocess
import sys

import pytest

from conformance.frontends.compare_runs import compare, exit_status
from conformance.recording import open_recording
from tests.conformance.test_torchrun import ONE_PER_AREA, _env, _torchrun

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("torchrun")]
ADAPTERS = ("refimpl-ddp", "refimpl-data-parallel", "refimpl-dist-autograd", "refimpl-bucketer", "refimpl-sharded")


def _areas(recording) -> dict[str, int]:
    """Recorded tensors per area (cases that ran)."""
    out: dict[str, int] = {}
    for doc in recording.cases.values():
        out[doc["area"]] = out.get(doc["area"], 0) + len(doc["entries"])
    return out


def test_run_and_torchrun_record_every_area_alike(tmp_path):
    selection = [a for s in ONE_PER_AREA for a in ("--scenario", s)] + [a for n in ADAPTERS for a in ("--adapter", n)]
    proc = _torchrun(*selection, "--report-dir", str(tmp_path / "tr-report"), "--record", str(tmp_path / "tr"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "recording: " in proc.stdout
    by_torchrun = open_recording(str(tmp_path / "tr"))
    assert by_torchrun.index["complete"] and by_torchrun.provenance["backend"] == "gloo"
    counts = _areas(by_torchrun)
    assert set(counts) == {"ddp", "data_parallel", "dist_autograd", "bucketer", "sharded"} and all(counts.values()), counts
    run = subprocess.run([sys.executable, "-m", "conformance.frontends.cli", "run", *selection, "--report-dir",
                          str(tmp_path / "run-report"), "--record", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=600, env=_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    by_run = open_recording(str(tmp_path / "run"))
    assert set(by_run.cases) == set(by_torchrun.cases)
    doc = compare(by_run, by_torchrun)
    assert exit_status(doc, "bitwise") == 0, doc["first"]
    assert doc["summary"]["compared"] == len(ONE_PER_AREA)


def test_the_zoo_records_through_the_same_pipeline(tmp_path):
    from conformance.frontends.zoo import run_cases
    from conformance.plan import Selection
    from conformance.recording import Recorder

    rec = Recorder(str(tmp_path))
    rec.start({})
    selection = Selection(adapters=("refimpl-bucketer",), areas=("bucketer",), ids=("bucketer/oversized/0.01mb/w2/fp32",))
    results = run_cases(["refimpl-bucketer"], selection, workers=1, timeout_scale=1.0, recorder=rec)
    rec.finish({})
    assert [r["verdict"] for r in results] == ["passed"]
    doc = open_recording(str(tmp_path)).cases["refimpl-bucketer|bucketer/oversized/0.01mb/w2/fp32"]
    assert doc["entries"] and {e["point"] for e in doc["entries"]} == {"callback", "after-flush"}
