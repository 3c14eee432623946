"""PyTorch's own distributed-autograd tests, run against refimpl.distributed_autograd.

The torch wheel ships its test suite for ``torch.distributed.autograd``
(``torch/testing/_internal/distributed/rpc/dist_autograd_test.py``). This module composes its
three CPU classes the way torch's ``test/distributed/rpc/test_tensorpipe_agent.py`` and
``test_faulty_agent.py`` do (``rpc_utils.generate_tests``): ``DistAutogradTest`` and
``TensorPipeAgentDistAutogradTest`` on the TensorPipe agent, ``FaultyAgentDistAutogradTest``
on the faulty TensorPipe agent. Each test runs in a world of 4 RPC workers (torch's
tests fix the world size), spawned by torch's own harness for each test.

Cost: a fresh world of 4 processes per test, so CI runs ``CI_SELECTION`` (the tests of every
failure class issue 16 found, plus the core backward tests); ``GRADPARITY_TORCH_SUITE=all``
runs all 96.

refimpl is swapped in for the names the tests call: the test module's ``dist_autograd``
(``context``, ``backward``, ``get_gradients``, ``_retrieve_context``, ``_current_context``,
``_get_debug_info``) and its ``rpc`` (``rpc_sync``, ``rpc_async``, ``remote``); torch's own
``RRef.to_here()`` records through refimpl once ``refimpl.distributed_autograd`` is imported.
Everything else (the agent, RRefs, the harness) stays torch's.

``GRADPARITY_DIST_AUTOGRAD_ENGINE=torch`` runs the same classes against torch itself (nothing
swapped, nothing excluded): the baseline every refimpl result is measured against.

Not run against refimpl, each named with its reason in ``TORCH_INTERNALS`` (the test reads
state only torch's C++ engine has) and ``DELIBERATE`` (refimpl differs on purpose).
"""

from __future__ import annotations

import os
import types
import unittest

import pytest

os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

pytest.importorskip("expecttest", reason="torch's test harness needs expecttest (extra: test)")

import torch.distributed.autograd as torch_dist_autograd  # noqa: E402
import torch.distributed.rpc as torch_rpc  # noqa: E402

if not torch_rpc.is_available():  # pragma: no cover - torch built without distributed
    pytest.skip("torch.distributed.rpc is not available", allow_module_level=True)

import torch.testing._internal.distributed.rpc.dist_autograd_test as torch_suite  # noqa: E402
from torch.testing._internal.distributed.rpc.faulty_rpc_agent_test_fixture import (  # noqa: E402
    FaultyRpcAgentTestFixture,
)
from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (  # noqa: E402
    TensorPipeRpcAgentTestFixture,
)
from torch.testing._internal.distributed.rpc_utils import generate_tests  # noqa: E402

import refimpl.distributed_autograd as refimpl_dist_autograd  # noqa: E402

ENGINE = os.environ.get("GRADPARITY_DIST_AUTOGRAD_ENGINE", "refimpl")
if ENGINE not in ("refimpl", "torch"):
    raise ValueError(
        f"GRADPARITY_DIST_AUTOGRAD_ENGINE={ENGINE!r}: use 'refimpl' (default) or 'torch'"
    )

pytestmark = pytest.mark.slow

# Tests that read state only torch's C++ engine keeps: test name -> the internal it reads.
# (refimpl offers, under torch's names, ``_current_context()`` with ``_context_id()`` and
# ``_known_worker_ids()``, ``_retrieve_context`` and ``_get_debug_info``; tests reading only
# those run.)
_GRAPH = (
    "context._send_functions() / _recv_functions() and the C++ node names "
    "torch::distributed::autograd::SendRpcBackward / RecvRpcBackward"
)
_SEND_RECV = "context._send_functions() / _recv_functions() (must be empty)"
TORCH_INTERNALS: dict[str, str] = {
    "test_graph_for_builtin_call": _GRAPH,
    "test_graph_for_builtin_call_sparse": _GRAPH,
    "test_graph_for_builtin_remote_call": _GRAPH,
    "test_graph_for_builtin_remote_call_sparse": _GRAPH,
    "test_graph_for_py_nested_call": _GRAPH,
    "test_graph_for_py_nested_call_sparse": _GRAPH,
    "test_graph_for_py_nested_call_itself": _GRAPH,
    "test_graph_for_py_nested_call_itself_sparse": _GRAPH,
    "test_graph_for_py_nested_remote_call": _GRAPH,
    "test_graph_for_py_nested_remote_call_sparse": _GRAPH,
    "test_graph_for_py_nested_remote_call_itself": _GRAPH,
    "test_graph_for_py_nested_remote_call_itself_sparse": _GRAPH,
    "test_graph_for_python_call": _GRAPH,
    "test_graph_for_python_call_sparse": _GRAPH,
    "test_graph_for_python_remote_call": _GRAPH,
    "test_graph_for_python_remote_call_sparse": _GRAPH,
    "test_no_graph_with_tensors_not_require_grad": _SEND_RECV,
    "test_no_graph_with_tensors_not_require_grad_sparse": _SEND_RECV,
    "test_no_graph_with_tensors_not_require_grad_remote": _SEND_RECV,
    "test_no_graph_with_tensors_not_require_grad_remote_sparse": _SEND_RECV,
    "test_rpc_complex_args": "context._send_functions() (the SendRpcBackward nodes and their count)",
    "test_rpc_complex_args_sparse": "context._send_functions() (the SendRpcBackward nodes and their count)",
    "test_remote_complex_args": "context._send_functions() (the SendRpcBackward nodes and their count)",
    "test_remote_complex_args_sparse": "context._send_functions() (the SendRpcBackward nodes and their count)",
    "test_autograd_context": "dist_autograd._get_max_id() (torch's context id layout)",
    "test_clean_context_during_backward": (
        "dist_autograd._new_context() / _release_context() and context._send_functions()"
    ),
    "test_dist_autograd_profiling": (
        "autograd profiler event names of torch's C++ engine (torch::distributed::autograd::...)"
    ),
}

# Tests where refimpl differs from torch on purpose: test name -> why.
DELIBERATE: dict[str, str] = {
    "test_backward_unused_send_function": (
        "expects torch's hang (FAST mode waits for a gradient on every send function); refimpl "
        "completes the pass (refimpl/distributed_autograd/engine.py [Note: several messages for "
        "one worker])"
    ),
}

# What CI runs (each spawns a world of 4): the failure classes of issue 16 and the core paths.
CI_SELECTION = frozenset(
    {
        "test_backward_simple",  # the core path
        "test_backward_rref_nested",  # torch's RRef.to_here() on another worker
        "test_thread_local_context_id",  # torch's RRef.to_here() inside the context
        "test_backward_simple_sparse",  # sparse tensors and gradients across RPCs
        "test_no_grad_copy_sparse",  # sparse gradients kept sparse, one buffer per leaf
        "test_backward_simple_script_call",  # TorchScript targets
        "test_context_cleanup_no_tensors",  # contexts on tensor-free workers
        "test_no_grad_copy",  # one gradient buffer per leaf
        "test_post_hooks",  # hooks on AccumulateGrad nodes
    }
)


class _Swapped(types.ModuleType):
    """A stand-in for a torch module: the swapped names, then the module's own."""

    def __init__(self, base: types.ModuleType, **swapped) -> None:
        super().__init__(base.__name__)
        self._base = base
        self.__dict__.update(swapped)

    def __getattr__(self, name):
        return getattr(self._base, name)


def _swap_in_refimpl() -> None:
    """Point torch's test module at refimpl (runs at import, so in every spawned rank too)."""
    da = refimpl_dist_autograd
    torch_suite.dist_autograd = _Swapped(
        torch_dist_autograd,
        context=da.context,
        backward=da.backward,
        get_gradients=da.get_gradients,
        _retrieve_context=da._retrieve_context,
        _current_context=da._current_context,
        _get_debug_info=da._get_debug_info,
    )
    torch_suite.rpc = _Swapped(
        torch_rpc, rpc_sync=da.rpc_sync, rpc_async=da.rpc_async, remote=da.remote
    )


def _not_run(cls: type, reasons: dict[str, str]) -> type:
    """Mark ``cls``'s listed tests skipped with their reason (the class is ours, not torch's)."""
    for name, reason in reasons.items():
        if hasattr(cls, name):
            setattr(cls, name, unittest.skip(reason)(getattr(cls, name)))
    return cls


if ENGINE == "refimpl":
    _swap_in_refimpl()

_CLASSES = {
    **generate_tests(
        "TensorPipe",
        TensorPipeRpcAgentTestFixture,
        [torch_suite.DistAutogradTest, torch_suite.TensorPipeAgentDistAutogradTest],
        __name__,
    ),
    **generate_tests(
        "Faulty", FaultyRpcAgentTestFixture, [torch_suite.FaultyAgentDistAutogradTest], __name__
    ),
}
ALL_TESTS = sorted(
    {name for cls in _CLASSES.values() for name in unittest.TestLoader().getTestCaseNames(cls)}
)
_reasons = {}
if ENGINE == "refimpl":
    _reasons.update({n: f"reads torch internals: {why}" for n, why in TORCH_INTERNALS.items()})
    _reasons.update({n: f"deliberate difference: {why}" for n, why in DELIBERATE.items()})
if os.environ.get("GRADPARITY_TORCH_SUITE", "ci") != "all":
    _reasons.update(
        {
            n: "outside the CI selection (GRADPARITY_TORCH_SUITE=all runs every test)"
            for n in ALL_TESTS
            if n not in CI_SELECTION and n not in _reasons
        }
    )
globals().update({name: _not_run(cls, _reasons) for name, cls in _CLASSES.items()})
