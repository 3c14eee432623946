"""ci/gpu-smoke.sh, the first thing a GPU session runs, on this CPU machine: it must say that no
GPU is present and exit with its documented code (3) after the CPU steps pass; and its DDP step,
run on the CPU, proves the step's own code (two gloo ranks, refimpl DDP, the device check on).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    # No GPU whatever this machine has: the documented no-GPU path is what is checked here.
    return {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}


def test_without_a_gpu_the_smoke_script_says_so_and_exits_3():
    out = subprocess.run(["bash", "ci/gpu-smoke.sh"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=300)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 3, out.stdout + out.stderr
    assert [line.split(":")[0] for line in lines] == [
        "[1/5] PASS torch", "[2/5] PASS refimpl", "[3/5] NO GPU gpu", "gpu-smoke"], out.stdout
    assert "torch.cuda.is_available() is False" in lines[2]
    assert lines[-1] == "gpu-smoke: no GPU present; 2 CPU step(s) passed, GPU steps not run (exit 3)"
    assert "Traceback" not in out.stdout + out.stderr


def test_the_readme_says_how_to_run_it_and_what_a_pass_and_no_gpu_look_like():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## On a GPU"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    assert "bash ci/gpu-smoke.sh" in section
    assert "gpu-smoke: all 5 steps passed (exit 0)" in section
    assert "gpu-smoke: no GPU present; 2 CPU step(s) passed, GPU steps not run (exit 3)" in section
    script = (ROOT / "ci" / "gpu-smoke.sh").read_text()
    assert 'echo "gpu-smoke: all ${#STEPS[@]} steps passed (exit 0)"' in script and "STEPS=(torch refimpl gpu ddp suite)" in script


@pytest.mark.slow
def test_the_ddp_step_passes_on_the_cpu():
    out = subprocess.run([sys.executable, "ci/gpu_smoke.py", "ddp", "--device", "cpu"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.strip().startswith("2 ranks, gloo, devices ['cpu', 'cpu']: one DDP step")
