"""Each independent data_parallel mutant is genuinely buggy: shown here outside the suite,
against the same pipeline without the bug (`Correct`) and against the module on the full batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conformance.mutants.independent import data_parallel as dp

DEVS = ["cpu", "cpu"]


class Scaled(nn.Module):
    """y = lin(x) * scale (+ shift): `scale` a per-row tensor keyword, `shift` a number."""

    def __init__(self, dim_in=4):
        super().__init__()
        self.lin = nn.Linear(dim_in, 2)
        with torch.no_grad():
            self.lin.weight.copy_(torch.arange(2 * dim_in, dtype=torch.float32).view(2, dim_in) - 3)
            self.lin.bias.fill_(1.0)

    def forward(self, x, scale=None, shift=0.0):
        y = self.lin(x)
        return y * scale.unsqueeze(-1) + shift if scale is not None else y + shift


def _x(rows=4, cols=4, dtype=torch.float32):
    return (torch.arange(rows * cols, dtype=dtype).view(rows, cols) % 5) - 2


def run(adapter, module, *args, dim=0, module_kwargs=None):
    return adapter.data_parallel(module, args, DEVS, None, dim, module_kwargs=module_kwargs)


def test_correct_matches_the_module():
    m, x = Scaled(), _x()
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(run(dp.correct(), m, x, module_kwargs={"scale": scale, "shift": 1.0}), m(x, scale=scale, shift=1.0))


@pytest.mark.parametrize("name", ["threads-drop-autocast", "replica0-inline"])
def test_autocast_not_seen_in_threads(name):
    m, x = Scaled(), _x()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        good = run(dp.correct(), m, x)
        bad = run(dp.MUTANTS[name](), m, x)
        local = m(x)
    assert good.dtype == local.dtype == torch.bfloat16 and torch.equal(good, local)
    assert bad.dtype != torch.bfloat16 or not torch.equal(bad, local)


def test_pool_grad_mode_from_first_call():
    m, x = Scaled(), _x()
    bad = dp.PoolGradModeFromFirstCall()
    with torch.no_grad():
        run(bad, m, x)
    out = run(bad, m, x)  # a training call after an evaluation call
    assert not out.requires_grad
    assert run(dp.correct(), m, x).requires_grad


def test_kwargs_unscattered_and_replica0_only():
    m, x = Scaled(), _x()
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = m(x, scale=scale)
    with pytest.raises(RuntimeError):
        run(dp.KwargsUnscattered(), m, x, module_kwargs={"scale": scale})
    assert not torch.equal(run(dp.KwargsReplica0Only(), m, x, module_kwargs={"scale": scale, "shift": 1.0}),
                           m(x, scale=scale, shift=1.0))
    assert torch.equal(run(dp.correct(), m, x, module_kwargs={"scale": scale}), expected)


def test_kwargs_batch_dim_zero():
    m = Scaled()
    x = _x(8, 4).view(2, 4, 4)  # batch along dim 1
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0]).expand(2, 4).contiguous()
    expected = m(x, scale=scale)
    assert torch.equal(run(dp.correct(), m, x, dim=1, module_kwargs={"scale": scale}), expected)
    with pytest.raises(RuntimeError):
        run(dp.KwargsBatchDimZero(), m, x, dim=1, module_kwargs={"scale": scale})


def test_mode_read_once():
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    x = _x()
    run(dp.ModeReadOnce(), m, x)
    m.eval()
    torch.manual_seed(0)
    assert not torch.allclose(run(dp.ModeReadOnce(), m, x), m(x))  # dropout still active
    assert torch.allclose(run(dp.correct(), m, x), m(x))  # random weights: not bitwise across splits


def _bn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


@pytest.mark.parametrize("name", ["probe-forward", "buffers-written-back-late"])
def test_buffers_of_replica0(name):
    good_m, bad_m, x = _bn(), _bn(), _x()
    run(dp.correct(), good_m, x)
    run(dp.MUTANTS[name](), bad_m, x)
    assert not torch.equal(good_m[1].running_mean, bad_m[1].running_mean)
    reference = _bn()
    reference(x[:2])  # replica 0's chunk updates the original's statistics (D9)
    assert torch.equal(good_m[1].running_mean, reference[1].running_mean)


def test_scalar_outputs_default_dtype():
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, dtype=torch.float64))

        def forward(self, x):
            return (x * self.w).sum()

    m, x = Loss(), _x(dtype=torch.float64)
    assert run(dp.correct(), m, x).dtype == torch.float64
    assert run(dp.ScalarOutputsDefaultDtype(), m, x).dtype == torch.float32


def test_fired_counts_only_where_the_bug_acts():
    m, x = Scaled(), _x()
    bad = dp.ThreadsDropAutocast()
    run(bad, m, x)
    assert bad.mutation_fired == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run(bad, m, x)
    assert bad.mutation_fired == 1
    kw = dp.KwargsReplica0Only()
    run(kw, m, x)
    assert kw.mutation_fired == 0
    run(kw, m, x, module_kwargs={"shift": 1.0})
    assert kw.mutation_fired == 1


def test_every_mutant_is_exercised_here():
    covered = {"threads-drop-autocast", "replica0-inline", "pool-grad-mode-from-first-call", "kwargs-unscattered",
               "kwargs-replica0-only", "kwargs-batch-dim-zero", "mode-read-once", "probe-forward",
               "buffers-written-back-late", "scalar-outputs-default-dtype"}
    assert covered == set(dp.MUTANTS)
