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
