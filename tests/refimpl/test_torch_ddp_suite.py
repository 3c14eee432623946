"""PyTorch's own CPU DDP tests, run with refimpl's DistributedDataParallel patched in.

`torch.testing._internal.distributed.distributed_test` is the test body of PyTorch's
`test/distributed/test_distributed_spawn.py`; its DDP tests build the wrapper as
`nn.parallel.DistributedDataParallel(...)`, so replacing that attribute in every spawned rank
(`_TorchDDPTestsOnRefimpl._run`, where a rank starts) runs them against refimpl. They run
with gloo at world size 2 through torch's own harness (a FileStore rendezvous, one process
per rank). Tests that read torch internals (the C++ reducer, DDP's logger) cannot apply to
another implementation and are listed with the reason, not run; tests that need CUDA devices
are skipped (with torch's own reason) on a machine without them.

Cost: torch's harness spawns a fresh world per test (about 10 s each on an idle 2-core
machine, several times that under load), so the module runs only what applies on CPU.
"""

from __future__ import annotations

import os
import tempfile
import unittest

import pytest
import torch

# torch's test bodies import expecttest (a torch dev dependency; our `test` extra installs it):
# without it the module is skipped with this reason rather than failing the whole run.
pytest.importorskip("expecttest", reason="pip install expecttest to run torch's own DDP tests against refimpl")

import refimpl  # noqa: E402

# [Note: nothing leaks into the pytest process]
# This module is imported wherever the suite is collected, and the tests after it in the same
# process (a long-lived xdist worker) must see torch as it is: torch-ddp must be torch's DDP
# (else refimpl-ddp counts as torch's DDP too, and loses torch DDP's CPU skips), and no rank
# pool may inherit torch's harness variables (WORLD_SIZE...). So refimpl's DDP is swapped in
# only inside each spawned rank, and the harness's environment lives only while this module's
# tests run (and while torch's test module is imported: it reads BACKEND then).
ENV = {"BACKEND": "gloo", "WORLD_SIZE": "2", "TEMP_DIR": tempfile.mkdtemp(prefix="gradparity-torch-ddp-tests-")}
_ADDED = [name for name in ENV if name not in os.environ]
os.environ.update({name: ENV[name] for name in _ADDED})
try:
    # The module, not its names: a `Test*` class in this namespace would be collected by pytest.
    from torch.testing._internal.distributed import distributed_test as _upstream  # noqa: E402
finally:
    for name in _ADDED:  # a spawned rank inherits them: nothing was added there
        del os.environ[name]

pytestmark = pytest.mark.slow


def _use_refimpl_ddp() -> None:
    """In a rank process: torch's DDP names (the attribute and torch's test module's own import
    of it) become refimpl's."""
    torch.nn.parallel.DistributedDataParallel = refimpl.DistributedDataParallel
    _upstream.DistributedDataParallel = refimpl.DistributedDataParallel


@pytest.fixture(autouse=True, scope="module")
def _harness_environment():
    """torch's harness variables while this module's tests run; the environment as it was after
    (its setUp also sets MASTER_ADDR and MASTER_PORT)."""
    saved = dict(os.environ)
    os.environ.update({name: value for name, value in ENV.items() if name not in os.environ})
    yield
    os.environ.clear()
    os.environ.update(saved)

# torch's DDP tests that run on CPU (gloo) and exercise the public API.
TESTS = [
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_ddp_create_graph",
    "test_accumulate_gradients_no_sync",
]
# Uneven-input (join) and other tests torch runs only with 2+ CUDA devices: here too. (Also
# CUDA-only upstream, not listed: test_ddp_sync_module_states, test_ddp_broadcast_buffer,
# test_ddp_static_graph_nested_types, test_ddp_sink_noclone, test_detect_ddp_is_actually_static,
# test_ddp_new_tensor_in_fwd_static_graph and the forward_sync_buffers tests.)
NEEDS_CUDA = [
    "test_ddp_grad_div_uneven_inputs",
    "test_ddp_join_model_equivalence",
    "test_ddp_uneven_input_join_disable",
    "test_ddp_uneven_input_exception",
    "test_ddp_returns_tensor_with_no_grad",
    "test_ddp_new_tensor_in_fwd",
]
# Not applicable: they assert on torch's C++ reducer or logger, not on DDP's behaviour.
NOT_APPLICABLE = {
    "test_ddp_logging_data_cpu": "reads DDP's C++ logger (ddp._get_ddp_logging_data())",
    "test_static_graph_api_cpu": "reads the C++ reducer's static-graph flags through ddp.logger",
}


class _TorchDDPTestsOnRefimpl(_upstream.TestDistBackend, _upstream.DistributedTest._DistTestBase):
    """torch's harness and test bodies; only TESTS run (below), not its hundreds of others."""

    __test__ = False  # a unittest class: pytest would collect every inherited test

    def setUp(self):  # as torch's test_distributed_spawn.py does
        super().setUp()
        self._spawn_processes()

    @classmethod
    def _run(cls, rank, *args, **kwargs):  # a spawned rank starts here (a process of its own)
        _use_refimpl_ddp()
        super()._run(rank, *args, **kwargs)


@pytest.mark.parametrize("name", TESTS + NEEDS_CUDA)
def test_torch_ddp_test_passes_on_refimpl(name):
    if name in NEEDS_CUDA and torch.cuda.device_count() < 2:
        pytest.skip(f"torch's {name} needs 2 CUDA devices")
    result = unittest.TestResult()
    _TorchDDPTestsOnRefimpl(name).run(result)
    problems = [text for _, text in result.errors + result.failures]
    assert not problems, f"torch's {name} with refimpl's DDP:\n" + "\n".join(problems)
    assert not result.skipped, f"torch's {name} was skipped: {result.skipped[0][1]}"
    assert result.testsRun == 1


def test_the_patch_is_in_place_in_a_rank_and_only_there():
    """A rank (a fresh process that imports this module: torch's harness pickles the test class
    by reference) swaps refimpl's DDP in where torch's test bodies look it up; importing this
    module, as collection does, leaves torch's DDP and the environment alone
    ([Note: nothing leaks into the pytest process])."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import os, torch, refimpl
before = dict(os.environ)
import tests.refimpl.test_torch_ddp_suite as suite
assert torch.nn.parallel.DistributedDataParallel is not refimpl.DistributedDataParallel
assert suite._upstream.DistributedDataParallel is not refimpl.DistributedDataParallel
assert dict(os.environ) == before, set(os.environ) ^ set(before)
suite._use_refimpl_ddp()
assert torch.nn.parallel.DistributedDataParallel is refimpl.DistributedDataParallel
assert suite._upstream.DistributedDataParallel is refimpl.DistributedDataParallel
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


def test_not_applicable_tests_exist_upstream():
    """The list of excluded tests stays true to torch's test suite."""
    for name in NOT_APPLICABLE:
        assert hasattr(_upstream.DistributedTest._DistTestBase, name), name
