"""The same plan and case pipeline under torchrun: rank 0 coordinates and writes the reports.

Kept cheap (one scenario per area; each test one torchrun world of 2 ranks): the quick profile
under torchrun is what `python -m conformance.frontends.torchrun --profile quick` runs by hand.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("torchrun")]

# One scenario of every area (data_parallel is single-process: it runs on rank 0 alone).
ONE_PER_AREA = ("ddp/plain/mlp/w2/fp32", "data_parallel/plain/mlp/r2/fp32", "dist_autograd/simple/w2/fp64",
                "bucketer/oversized/0.01mb/w2/fp32", "sharded/plain/mlp/w2/fp32")

ABORTING = textwrap.dedent(
    """
    import os

    import torch.distributed as dist
    import torch.nn.parallel


    class AbortOnRank1(torch.nn.parallel.DistributedDataParallel):
        '''torch DDP whose rank 1 dies in its first forward (SIGABRT, as a failed gloo enforce does).'''

        def forward(self, *args, **kwargs):
            if dist.get_rank() == 1:
                os.abort()
            return super().forward(*args, **kwargs)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra_path: str = "") -> dict:
    env = {**os.environ, "GRADPARITY_DEVICE": "cpu", "GLOO_SOCKET_IFNAME": "lo"}
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _torchrun(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "conformance.frontends.torchrun", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or _env())


def _results(report_dir, proc: subprocess.CompletedProcess) -> dict:
    report = report_dir / "gradparity.json"
    # no report: what torchrun and rank 0 printed is the only account of why
    assert report.exists(), f"no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return {r["case"]: r for r in json.loads(report.read_text())["results"]}


def test_every_area_runs_with_the_default_adapters(tmp_path):
    """No --adapter: every built-in adapter; a case of every area passes (or is skipped with the reason)."""
    # plus a known upstream failure (torch-ddp's xfail) and a w1 scenario, which a 2-rank world does not select
    extra = ("ddp/unused-without-fuf/branches/w2/fp32", "ddp/plain/mlp/w1/fp32")
    args = [a for s in ONE_PER_AREA + extra for a in ("--scenario", s)]
    proc = _torchrun(*args, "--report-dir", str(tmp_path))
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    results = _results(tmp_path, proc)
    passed = {r["area"] for r in results.values() if r["verdict"] == "passed"}
    assert passed == {"ddp", "data_parallel", "dist_autograd", "bucketer", "sharded"}, results
    assert not any(r["scenario"] == "ddp/plain/mlp/w1/fp32" for r in results.values())
    xfailed = results["torch-ddp|ddp/unused-without-fuf/branches/w2/fp32"]
    assert xfailed["verdict"] == "xfailed" and "128949" in xfailed["xfail_reason"]
    assert "gradients differ from the oracle" in xfailed["message"]  # the error actually seen
    assert results["refimpl-ddp|ddp/unused-without-fuf/branches/w2/fp32"]["verdict"] == "passed"
    skipped = [r for r in results.values() if r["verdict"] == "skipped"]
    assert all(r["message"] for r in skipped)  # e.g. torch-data-parallel: needs CUDA devices
    # the terminal says what `gradparity run` says: progress with reasons, then the summary table
    assert "gradparity conformance summary" in out and "SKIPPED torch-data-parallel|data_parallel/plain/mlp/r2/fp32: " in out
    junit = (tmp_path / "junit.xml").read_text()
    assert 'name="gradparity"' in junit and junit.count("<testcase") == len(results)


def test_a_rank_abort_keeps_the_report(tmp_path):
    """Rank 1 dies (SIGABRT): the world cannot be respawned, yet every planned case is in the
    report — those that never ran as errors that say why — and the terminal names the cause."""
    (tmp_path / "aborting_ddp.py").write_text(ABORTING)
    report_dir = tmp_path / "out"
    proc = _torchrun("--ddp-class", "aborting_ddp:AbortOnRank1", "--scenario", "ddp/plain/mlp/w2/fp32",
                     "--scenario", "ddp/adam/mlp/w2/fp32", "--scenario", "ddp/no-sync/mlp/w2/fp32",
                     "--report-dir", str(report_dir), "--timeout", "60", env=_env(str(tmp_path)))
    assert proc.returncode != 0
    results = _results(report_dir, proc)
    assert len(results) == 3 and not any(r["verdict"] == "passed" for r in results.values()), results
    never = [r for r in results.values() if r["verdict"] == "error"]
    assert len(never) >= 2 and all(r["cause"].startswith("never ran: ") for r in never), never
    crashed = [r for r in results.values() if r["verdict"] == "failed"]
    assert all(r["failure_class"] == "crashed" for r in crashed), crashed  # when rank 0 got to judge it
    junit = (report_dir / "junit.xml").read_text()
    assert junit.count("<testcase") == 3
    assert "never ran: " in proc.stdout


def test_two_agents_rendezvous_like_two_nodes(tmp_path):
    """Multi-node on one machine: two torchrun agents (`--nnodes 2`), c10d rendezvous on 127.0.0.1."""
    port = _free_port()

    def agent(node: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "gradparity-test", "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
               "--local-addr", "127.0.0.1", "-m", "conformance.frontends.torchrun", "--adapter", "refimpl-ddp",
               "--scenario", "ddp/no-sync/mlp/w2/fp32", "--report-dir", str(tmp_path / f"node{node}")]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())

    agents = [agent(0), agent(1)]
    try:
        outs = [a.communicate(timeout=300)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-2000:] for o in outs)
    reports = [p for p in tmp_path.glob("node*/gradparity.json")]
    assert len(reports) == 1, reports  # only global rank 0 coordinates and writes
    (result,) = json.loads(reports[0].read_text())["results"]
    assert result["verdict"] == "passed" and result["case"] == "refimpl-ddp|ddp/no-sync/mlp/w2/fp32"


@pytest.mark.parametrize("args, needle", [(["--profile", "huge"], "invalid choice: 'huge'"),
                                          (["--adapter", "nope"], "unknown adapter 'nope'")])
def test_the_launcher_refuses_bad_input_with_one_line(args, needle):
    """Before any rendezvous: one line, exit 2 (not argparse's usage block)."""
    proc = subprocess.run([sys.executable, "-m", "conformance.frontends.torchrun", *args],
                          capture_output=True, text=True, timeout=300)
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(err) == 1 and needle in err[0], proc.stderr
