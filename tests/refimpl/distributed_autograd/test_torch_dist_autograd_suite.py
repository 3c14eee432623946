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
(``DIST_AUTOGRAD_NAMES``: ``context``, ``backward``, ``get_gradients`` and torch's private
``_retrieve_context``, ``_current_context``, ``_get_debug_info``, ``_new_context``,
``_release_context``, ``_get_max_id``) and its ``rpc`` (``rpc_sync``, ``rpc_async``,
``remote``); torch's own ``RRef.to_here()`` records through refimpl once
``refimpl.distributed_autograd`` is imported. Everything else (the agent, RRefs, the harness)
stays torch's. Any other private name a test reads raises instead of reaching torch's engine.

``GRADPARITY_DIST_AUTOGRAD_ENGINE=torch`` runs the same classes against torch itself (nothing
swapped, nothing excluded): the baseline every refimpl result is measured against.

Not run against refimpl: the tests in ``DELIBERATE`` (refimpl differs on purpose), each with
its reason.
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

# Tests where refimpl differs from torch on purpose: test name -> why.
DELIBERATE: dict[str, str] = {
    "test_backward_unused_send_function": (
        "expects torch's hang (FAST mode waits for a gradient on every send function); refimpl "
        "completes the pass (refimpl/distributed_autograd/engine.py [Note: several messages for "
        "one worker])"
    ),
}

# What CI runs (each spawns a world of 4): the failure classes of issue 16, the core paths, the
# private API torch's tests read, and every class (test_ci_selection_covers_every_class).
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
        "test_graph_for_py_nested_call",  # _send_functions / _recv_functions, torch's node names
        "test_clean_context_during_backward",  # _new_context / _release_context
        "test_dist_autograd_profiling",  # profiler scopes under torch's names
        "test_context_cleanup_tensor_with_grad",  # the faulty agent's class
    }
)


class _Swapped(types.ModuleType):
    """A stand-in for a torch module: the swapped names, then the module's own public names.

    A private name (one underscore) that is neither swapped nor listed in ``torch_private``
    raises: torch's test module reaches torch's engine state through private names
    (``_new_context``, ``_get_max_id``, ...), and one that fell through to torch would let a
    test pass on torch's engine while it claims refimpl's.
    """

    def __init__(self, base: types.ModuleType, torch_private=(), **swapped) -> None:
        super().__init__(base.__name__)
        self._base = base
        self._torch_private = frozenset(torch_private)
        self.__dict__.update(swapped)

    def __getattr__(self, name):
        private = name.startswith("_") and not name.startswith("__")
        if private and name not in self._torch_private:
            raise AttributeError(
                f"{self.__name__}.{name} is not swapped for refimpl's: add it to "
                "_swap_in_refimpl (or, if it is not the engine's, to its torch_private)"
            )
        return getattr(self._base, name)


# The test module's names that refimpl replaces, and the private names of torch's RPC module it
# may still reach (the agent's, not the engine's: refimpl runs over torch's agent).
DIST_AUTOGRAD_NAMES = (
    "context",
    "backward",
    "get_gradients",
    "_retrieve_context",
    "_current_context",
    "_get_debug_info",
    "_new_context",
    "_release_context",
    "_get_max_id",
)
RPC_NAMES = ("rpc_sync", "rpc_async", "remote")
RPC_TORCH_PRIVATE = ("_set_rpc_timeout",)


def _swap_in_refimpl() -> None:
    """Point torch's test module at refimpl (runs at import, so in every spawned rank too)."""
    da = refimpl_dist_autograd
    torch_suite.dist_autograd = _Swapped(
        torch_dist_autograd, **{n: getattr(da, n) for n in DIST_AUTOGRAD_NAMES}
    )
    torch_suite.rpc = _Swapped(
        torch_rpc, RPC_TORCH_PRIVATE, **{n: getattr(da, n) for n in RPC_NAMES}
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


def test_ci_selection_covers_every_class():
    """CI's selection and the exclusions name real tests, and CI runs some of every class."""
    names = set(ALL_TESTS)
    assert CI_SELECTION <= names and set(DELIBERATE) <= names
    assert not CI_SELECTION & set(DELIBERATE)
    for cls_name, cls in _CLASSES.items():
        own = set(unittest.TestLoader().getTestCaseNames(cls))
        assert own & CI_SELECTION, f"CI runs none of {cls_name}"


@pytest.mark.skipif(ENGINE != "refimpl", reason="nothing is swapped when torch is measured")
def test_the_swap_refuses_private_names_it_does_not_replace():
    """A private name torch's module has but refimpl does not replace raises, not falls through."""
    assert hasattr(torch_dist_autograd, "_init") and hasattr(torch_rpc, "_get_current_rpc_agent")
    with pytest.raises(AttributeError, match="not swapped for refimpl's"):
        torch_suite.dist_autograd._init  # noqa: B018
    with pytest.raises(AttributeError, match="not swapped for refimpl's"):
        torch_suite.rpc._get_current_rpc_agent  # noqa: B018
    for name in DIST_AUTOGRAD_NAMES:
        assert getattr(torch_suite.dist_autograd, name) is getattr(refimpl_dist_autograd, name)
    assert torch_suite.rpc._set_rpc_timeout is torch_rpc._set_rpc_timeout  # the agent's
    assert torch_suite.rpc.shutdown is torch_rpc.shutdown
