"""The README and docs/ stay true: length, the two commands, links, counts, the refimpl example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            lines.append(_anchor(line.lstrip("#")))
    return set(lines)


def test_the_readme_is_a_page_and_starts_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    assert 'python3 -m pip install "tox>=4.11" && python3 -m tox -e suite' in first_block
    assert 'python3 -m pip install "tox>=4.11" && python3 -m tox -e tests' in first_block


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    if not doc.exists():
        pytest.fail(f"{doc.relative_to(ROOT)} is missing")
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_counts_are_the_code_counts():
    from conformance import catalogue, mutants

    text = README.read_text()
    for profile in catalogue.PROFILES:  # sizes change with every new scenario: the README names none
        assert not re.search(rf"`{profile}` \(\d+", text), f"README: {profile}'s size is for `gradparity list`"
    n = len(mutants.area_zoo("ddp").mutants)
    assert f"against {n} deliberately broken DDPs" in text, f"README: the DDP zoo has {n} mutants"


@pytest.mark.slow
def test_the_readme_training_loop_runs(tmp_path):
    """The README's refimpl example, as written, in a one-rank gloo world on loopback."""
    snippet = README.read_text().split("```python", 1)[1].split("```", 1)[0]
    script = textwrap.dedent(f"""
        import datetime, torch, torch.distributed as dist
        from conformance.harness.network import join_local_group
        join_local_group({str(tmp_path / "store")!r}, 0, 1, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group = lambda *a, **k: None  # joined above, on loopback only
        torch.manual_seed(0)
        batches = [(torch.randn(8, 16), torch.randn(8, 1)) for _ in range(3)]
        before = None
        """) + snippet + textwrap.dedent("""
        import refimpl
        assert isinstance(ddp, refimpl.DistributedDataParallel)
        assert all(p.grad is not None for p in model.parameters())
        print("readme example ran")
        """)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "readme example ran" in proc.stdout, proc.stderr


@pytest.mark.slow
def test_the_your_model_page_runs_as_written(tmp_path):
    """docs/your-model.md: its model file, its command and its Python example, as written, in a fresh directory."""
    page = (ROOT / "docs" / "your-model.md").read_text()
    model_file, example = (block.split("```", 1)[0] for block in page.split("```python\n")[1:3])
    command = page.split("```bash\n", 1)[1].split("```", 1)[0].strip()
    assert len(model_file.strip().splitlines()) <= 12 and len(example.strip().splitlines()) <= 10
    (tmp_path / "my_model.py").write_text(model_file)
    (tmp_path / "example.py").write_text(example)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    gradparity = [sys.executable, "-m", "conformance.frontends.cli"]
    argv = gradparity + command.split()[1:] + ["--report-dir", str(tmp_path / "reports")]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "torch-ddp|ddp/plain/my_model:build/w2/fp32" in (tmp_path / "reports" / "gradparity.json").read_text()
    assert "note: forward draws random numbers (dropout)" in proc.stderr
    proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0 and "my_model:build: conformant" in proc.stdout, proc.stdout[-3000:] + proc.stderr
    bad = subprocess.run(gradparity + ["run", "--model", "my_model:nope", "--batch", "my_model:batch"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "has no attribute 'nope'" in bad.stderr
