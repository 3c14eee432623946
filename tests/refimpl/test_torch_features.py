"""Feature detection in refimpl/_torch_features.py: each fallback works on a torch with the
attribute missing (a view of torch that hides it stands for an older or newer torch: deleting
it from torch itself would break torch's own code in this process), a feature that cannot be
emulated gives a one-line message at import and a one-line error when used, and the torch range
pyproject.toml declares is the one CI installs and the GPU image builds on.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refimpl import _torch_features as features

ROOT = Path(__file__).resolve().parents[2]


class _Hiding:
    """``obj`` seen through a view that lacks the attributes in ``hidden`` ("a.b" reaches in)."""

    def __init__(self, obj, *hidden: str) -> None:
        self._obj, self._hidden = obj, hidden

    def __getattr__(self, name: str):
        if name in self._hidden:
            raise AttributeError(name)
        inner = [h.split(".", 1)[1] for h in self._hidden if h.startswith(name + ".")]
        value = getattr(self._obj, name)
        return _Hiding(value, *inner) if inner else value


def without(*dotted: str):
    """torch as a torch that lacks ``dotted`` names (relative to ``torch``)."""
    return _Hiding(torch, *dotted)


def test_tls_without_remove_emulates_removal_with_the_same_answers():
    has, get, stash, remove = features.resolve_autograd_tls(without("_C._remove_obj_from_tls"))
    assert remove is not torch._C._remove_obj_from_tls
    key = "refimpl-features-test"
    assert not has(key)
    seen = []
    leaf = torch.ones(2, requires_grad=True)
    leaf.register_hook(lambda g: seen.append(get(key) if has(key) else None))
    marker = object()
    stash(key, marker)
    try:
        (leaf * 3).sum().backward()  # the stash follows the backward, as with torch's removal
    finally:
        remove(key)
    assert seen == [marker] and not has(key)
    (leaf * 3).sum().backward()
    assert seen == [marker, None]  # removed: the next backward sees nothing


def test_tls_without_stash_is_missing_and_says_so_in_one_line():
    has, get, stash, remove = features.resolve_autograd_tls(without("_C._stash_obj_in_tls"))
    assert all(isinstance(f, features.Missing) for f in (has, get, stash, remove))
    with pytest.raises(RuntimeError) as err:
        stash("k", object())
    line = str(err.value)
    assert "\n" not in line and "torch._C._stash_obj_in_tls" in line and "gradient capture" in line
    assert "torch>=2.13,<2.14" in line


def test_engine_run_backward_without_the_graph_helper_falls_back_to_the_engine():
    run = features.resolve_engine_run_backward(without("autograd.graph._engine_run_backward"))
    assert not isinstance(run, features.Missing) and run is not torch.autograd.graph._engine_run_backward
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    run(((a * a).sum(),), (torch.ones(()),), False, False, (), allow_unreachable=True, accumulate_grad=True)
    assert torch.equal(a.grad, torch.tensor([2.0, 4.0]))


def test_queue_callback_without_the_engine_method_is_missing():
    queue = features.resolve_queue_callback(without("autograd.Variable._execution_engine.queue_callback"))
    assert isinstance(queue, features.Missing)
    with pytest.raises(RuntimeError, match="DDP reducer"):
        queue(lambda: None)


def test_profiler_enabled_without_the_query_says_always():
    assert features.resolve_profiler_enabled(torch) is torch.autograd._profiler_enabled
    assert features.resolve_profiler_enabled(without("autograd._profiler_enabled"))() is True  # scopes always opened: correct, slower


def test_node_hook_watch_without_the_register_helper_reports_hooks_as_seen(monkeypatch):
    from refimpl import _torch_compat as compat

    assert features.resolve_register_hook(without("autograd.Function._register_hook")) is None
    monkeypatch.setattr(compat.features, "resolve_register_hook", lambda torch: None)
    assert compat._NodeHookWatch().seen  # the safe answer: a hook may be there


def test_accelerator_available_without_torch_accelerator_asks_cuda(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or False)
    assert features.resolve_accelerator_available(without("accelerator"))() is False and asked == [1]


_IMPORT_WITHOUT = """
import sys, torch
for name in sys.argv[1:]:
    delattr(torch._C, name)
from refimpl import DistributedDataParallel  # imports refimpl._torch_compat
from refimpl.distributed_autograd.capture import Capture
try:
    with Capture(1, 0):
        pass
except RuntimeError as exc:
    print("raised:", exc)
else:
    print("captured")
"""


def _import_without(*names: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _IMPORT_WITHOUT, *names], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_import_on_a_torch_lacking_tls_removal_works_silently():
    out = _import_without("_remove_obj_from_tls")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "captured" and out.stderr == ""


def test_import_on_a_torch_lacking_a_feature_prints_one_line_not_an_attribute_error():
    out = _import_without("_remove_obj_from_tls", "_stash_obj_in_tls")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "TorchFeatureWarning" in lines[0] and "torch._C._stash_obj_in_tls" in lines[0]
    assert "AttributeError" not in out.stderr
    assert out.stdout.startswith("raised: distributed autograd's gradient capture needs")


def _pyproject_torch_range() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"torch([^"]*)"', text).group(1)


def test_declared_torch_range_is_the_tested_minor_release():
    """pyproject.toml names exactly the minor release CI installs (constraints.txt) and the
    feature layer names; the install hint says the same range."""
    pinned = re.search(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    assert _pyproject_torch_range() == f">={features.TESTED_TORCH},<2.14"
    assert pinned.startswith(features.TESTED_TORCH + ".")
    assert f"torch{_pyproject_torch_range()}" in features.INSTALL_HINT
    assert torch.__version__.startswith(features.TESTED_TORCH + ".")  # this run proves it


def test_gpu_image_installs_the_pinned_torch():
    """The Dockerfile installs through constraints.txt (a CUDA build of the pinned torch from
    the package index) instead of a base image's own torch of another version."""
    docker = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"^FROM\s+pytorch/pytorch", docker, re.M), "a pytorch/pytorch base brings its own torch"
    assert re.search(r"pip install[^\n]*-c constraints\.txt", docker) or "PIP_CONSTRAINT" in docker
    assert "constraints.txt" in docker
