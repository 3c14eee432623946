"""The same rank loop under torchrun: rank 0 coordinates and writes the report."""

import json
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("torchrun")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "conformance.harness.torchrun", "--adapter", "torch-ddp",
           "--scenario", "ddp/no-sync/mlp/w2/fp32", "--scenario", "ddp/unused-without-fuf/branches/w2/fp32",
           "--scenario", "ddp/plain/mlp/w1/fp32", "--report-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={"GRADPARITY_DEVICE": "cpu", **__import__("os").environ})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gradparity.json").read_text())
    verdicts = {r["scenario"]: r["verdict"] for r in report["results"]}
    # the w1 scenario does not fit a 2-rank world and is not selected
    assert verdicts == {"ddp/no-sync/mlp/w2/fp32": "passed", "ddp/unused-without-fuf/branches/w2/fp32": "xfailed"}
