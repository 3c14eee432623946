"""Every private torch API refimpl and the conformance suite use, in one place.

Private names change between torch releases without notice. Each one used anywhere in
``refimpl`` or ``conformance`` is reached through this module, with a comment saying why no
public API does the job, and each is pinned by ``tests/refimpl/test_torch_compat.py`` (it
exists on this torch and behaves as used). A torch upgrade that breaks one fails that test by
name instead of a distant scenario.

refimpl imports only torch, so the suite imports from here too (``conformance`` depends on
``refimpl``, never the other way round).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence

import torch

from . import _torch_features as features

__all__ = [
    "accelerator_available",
    "autograd_tls_get",
    "autograd_tls_has",
    "autograd_tls_remove",
    "autograd_tls_stash",
    "engine_run_backward",
    "find_script_function",
    "rref_class",
    "set_group_timeout",
    "MODULE_BUFFERS",
    "MODULE_CHILDREN",
    "MODULE_PARAMETERS",
    "composable_fully_shard",
    "current_rpc_agent",
    "current_rpc_agent_function",
    "composable_replicate",
    "ddp_mixed_precision",
    "dist_autograd_debug_info",
    "flatten_dense",
    "foreach_copy_",
    "functional_optimizer",
    "hook_dict",
    "node_hooks_seen",
    "profiler_enabled",
    "fsdp2_unsharded_grads",
    "fsdp_flat_param",
    "fsdp_unflat_views",
    "queue_backward_callback",
    "sparse_values",
]


# -- autograd -------------------------------------------------------------------------------
def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the autograd graph task that is running now finishes.

    torch has no public "backward finished" hook; DDP's reducer, FSDP and the sharded engine
    all need one to wait for their collectives at the end of backward. Callable only from
    inside a backward (a gradient hook or a node pre-hook).
    """
    _queue_callback(callback)


_queue_callback = features.resolve_queue_callback(torch)


# Direct aliases (no wrapper frame): distributed autograd reads the capture in every leaf hook.
# ``stash(key, obj)`` puts ``obj`` in the thread-local state that autograd propagates to the
# threads running a backward (a Python ``threading.local`` would not follow it there).
# Found by feature detection (``_torch_features.resolve_autograd_tls``: an emulated removal on a
# torch without ``_remove_obj_from_tls``).
autograd_tls_has, autograd_tls_get, autograd_tls_stash, autograd_tls_remove = features.resolve_autograd_tls(torch)

# Whether the autograd profiler records on this thread (a direct alias: distributed autograd asks
# on every backward, and opens torch's ``record_function`` scopes only then; entering a
# ``record_function`` costs microseconds even when nothing records, and no public API tells).
profiler_enabled = features.resolve_profiler_enabled(torch)


def hook_dict(handle):
    """The ordered dict of hooks a ``RemovableHandle`` from ``node.register_prehook`` belongs to
    (``None`` once that dict is gone).

    Autograd runs a node's Python pre-hooks in this dict's insertion order; distributed
    autograd checks that its capture hook is last, so that users' hooks run first. No public
    API lists a node's hooks.
    """
    return handle.hooks_dict_ref()


# Whether any Python hook was ever put on an autograd node in this process ([Note: watching node
# hooks]). No public API lists a node's hooks, so the registration is watched instead.
class _NodeHookWatch:
    """[Note: watching node hooks]
    ``node.register_prehook(fn)`` and ``node.register_hook(fn)`` (on any autograd node, C++ or
    Python) store ``fn`` through ``torch.autograd.Function._register_hook``, which torch looks up
    by name on every call. Wrapping it tells when the first such hook appears, anywhere; nothing
    else changes (the wrapper calls torch's). Distributed autograd captures leaf gradients in C++
    while no Python node hook exists (capture.py [Note: two ways to capture]).

    The wrapper proves itself when installed: it registers a pre-hook on a throwaway node and
    must see it. If it does not (torch stopped looking the helper up), :attr:`seen` stays true
    for good, so that a hook can never be missed.
    """

    def __init__(self) -> None:
        self.seen = True
        original = features.resolve_register_hook(torch)
        if original is None:
            return  # torch has no such helper: a hook may always be there

        def _register_hook(backward_hooks, hook):
            self.seen = True
            return original(backward_hooks, hook)

        torch.autograd.Function._register_hook = staticmethod(_register_hook)
        self.seen = False
        leaf = torch.empty(0, requires_grad=True)
        node = (leaf * 1).grad_fn
        node.register_prehook(lambda grad_outputs: None).remove()
        self.seen = not self.seen  # saw the probe: nothing seen yet; missed it: always "seen"


_node_hook_watch = _NodeHookWatch()


def node_hooks_seen() -> bool:
    """Whether a Python pre-hook or post hook may be on some autograd node of this process (put
    there since ``refimpl`` was imported; see [Note: watching node hooks]). Once true, true for
    the rest of the process."""
    return _node_hook_watch.seen


# ``torch.autograd.backward`` minus its per-tensor Python argument checks: the engine entry
# point ``backward`` itself ends in (distributed autograd's local runs call it directly).
engine_run_backward = features.resolve_engine_run_backward(torch)

# Whether torch sees an accelerator (``torch.accelerator`` is torch >= 2.6; CUDA before).
accelerator_available = features.resolve_accelerator_available(torch)


def functional_optimizer(optimizer_class):
    """torch's functional twin of ``optimizer_class`` (``torch.optim.SGD`` ->
    ``_FunctionalSGD``: the same update, stepped with a list of gradients, without
    ``Optimizer.step``'s hook and profiler machinery), or ``None``. torch's own
    ``DistributedOptimizer`` steps its owners' parameters with these; no public API names them.
    """
    from torch.distributed.optim.utils import functional_optim_map

    return functional_optim_map.get(optimizer_class)


# -- tensors --------------------------------------------------------------------------------
def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i in one call (one kernel launch per dtype/device
    group instead of one per tensor: the reducer's copy-back of many small gradients)."""
    torch._foreach_copy_(list(dst), list(src))


def flatten_dense(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' values back to back in one new 1-D tensor (one call: the gradient
    channel's frame of 100 small gradients; ``torch.cat`` of 100 reshaped views costs 100
    Python calls). Lazy conjugate / negative bits are materialized, except for a single
    tensor that is already contiguous (it comes back as a view: resolve it yourself)."""
    return torch._utils._flatten_dense_tensors(tensors)


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """A sparse COO tensor's values, coalesced or not (``values()`` refuses uncoalesced ones).

    The suite uses it only to find which storage a sparse gradient lives in.
    """
    return t._values()


# -- nn.Module internals ----------------------------------------------------------------------
# ``replicate`` builds shallow module copies by editing these instance dicts directly (as
# torch's own ``nn.parallel.replicate`` does): going through ``register_parameter`` would
# refuse non-leaf tensors, which is exactly what a replica's parameters are.
MODULE_PARAMETERS = "_parameters"
MODULE_BUFFERS = "_buffers"
MODULE_CHILDREN = "_modules"


# -- distributed ------------------------------------------------------------------------------
def ddp_bucket_assignment(params, limits, expect_sparse, tensor_indices=None):
    """torch DDP's own bucket assignment (the C++ ``_compute_bucket_assignment_by_size``).

    The conformance suite's PowerSGD oracle needs the exact buckets torch's reducer forms, since
    PowerSGD compresses per bucket; re-deriving them would model torch instead of asking it.
    """
    import torch.distributed as dist

    if tensor_indices is None:
        return dist._compute_bucket_assignment_by_size(params, limits, expect_sparse)
    return dist._compute_bucket_assignment_by_size(params, limits, expect_sparse, tensor_indices)


def set_group_timeout(group, timeout) -> None:
    """Change an existing process group's collective timeout (gloo, NCCL).

    The suite bounds each task's NCCL collectives by that task's budget (a hung collective then
    raises under ``TORCH_NCCL_BLOCKING_WAIT``); a group's timeout is otherwise fixed when it is
    made, and no public API changes it.
    """
    import torch.distributed as dist

    dist.distributed_c10d._set_pg_timeout(timeout, group)


def ddp_first_bucket_bytes() -> int:
    """The size cap of DDP's first bucket when ``bucket_cap_mb`` is left at its default."""
    import torch.distributed as dist

    return dist._DEFAULT_FIRST_BUCKET_BYTES


def ddp_mixed_precision(reduce_dtype: torch.dtype):
    """torch DDP's ``mixed_precision=`` argument reducing gradients in ``reduce_dtype``.

    ``torch.nn.parallel.distributed._MixedPrecision`` is the only way to ask torch's DDP (and
    refimpl's, which takes the same object) for low-precision gradient communication.
    """
    from torch.nn.parallel.distributed import _MixedPrecision

    return _MixedPrecision(reduce_dtype=reduce_dtype)


def current_rpc_agent():
    """The process's RPC agent object (raises ``RuntimeError`` when none is set).

    refimpl's distributed autograd keeps its per-worker state (contexts, the gradient channel)
    for one agent: when the agent is shut down and another initialized, the state must go with
    it. ``rpc.get_worker_info()`` tells the worker, not the agent incarnation; only the agent
    object does.
    """
    return current_rpc_agent_function()()


def current_rpc_agent_function():
    """The function behind :func:`current_rpc_agent`, for callers that ask on every message
    (the distributed autograd engine checks the agent per gradient message: one C call, not
    two Python calls and an import statement)."""
    from torch.distributed.rpc.api import _get_current_rpc_agent

    return _get_current_rpc_agent


def dist_autograd_debug_info() -> dict[str, str]:
    """torch.distributed.autograd's per-worker counters (contexts, backward passes).

    The only view of how many contexts a worker still holds; the suite's cleanup check polls it.
    """
    import torch.distributed.autograd as dist_autograd

    return dist_autograd._get_debug_info()


def fsdp2_unsharded_grads(module) -> dict[int, torch.Tensor | None]:
    """FSDP2 (``fully_shard``): each parameter's local *unsharded* gradient, by ``id`` of the
    sharded parameter the module exposes.

    Under ``set_requires_gradient_sync(False)`` FSDP2 accumulates into per-parameter state
    (``FSDPParam.unsharded_accumulated_grad``, or the unsharded parameter's ``.grad``) that no
    public API shows. Read only.
    """
    group = module._get_fsdp_state()._fsdp_param_group
    out: dict[int, torch.Tensor | None] = {}
    for fsdp_param in group.fsdp_params if group is not None else []:
        grad = getattr(fsdp_param, "unsharded_accumulated_grad", None)
        if grad is None:
            unsharded = getattr(fsdp_param, "unsharded_param", None)
            grad = None if unsharded is None else unsharded.grad
        out[id(fsdp_param.sharded_param)] = grad
    return out


def rref_class() -> type:
    """The C++ RRef class ``torch.distributed.rpc.RRef`` derives from (its ``to_here`` is the
    method distributed autograd wraps so a fetched value records a gradient edge)."""
    from torch._C._distributed_rpc import PyRRef

    return PyRRef


def find_script_function(qualified_name: str):
    """The TorchScript function compiled under ``qualified_name`` in this process, or None.

    Distributed autograd ships a scripted RPC target by name; no public API looks one up.
    """
    return torch.jit._state._python_cu.find_function(qualified_name)


def eager_under_compile(fn):
    """``torch.compiler.disable(fn)``, built the first time a compiled region calls ``fn``.

    ``torch.compiler.disable`` imports dynamo, which takes seconds: applied when a class body is
    executed, it made every process that imports refimpl's DDP (each rank, and the suite's
    planner) pay that import without ever compiling. Under tracing ``is_compiling()`` is true, so
    the traced code calls the disabled function, which runs eagerly (a graph break); outside
    tracing ``fn`` runs as it is.
    """
    disabled: list = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            if not disabled:
                disabled.append(torch.compiler.disable(fn))
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def dynamo_python_reducer():
    """A context in which torch DDP builds its Python reducer (``optimize_ddp="python_reducer"``):
    the only mode in which it reduces under compiled autograd (its C++ reducer refuses it)."""
    return importlib.import_module("torch._dynamo").config.patch(optimize_ddp="python_reducer")


def compiled_autograd_enabled(compiler):
    """A context in which backward runs under compiled autograd with ``compiler`` (no public API)."""
    return importlib.import_module("torch._dynamo.compiled_autograd")._enable(compiler)


def mkldnn_fp16_supported() -> bool:
    """Whether oneDNN has fp16 kernels on this CPU (what DeepSpeed's CPU accelerator asks before it
    accepts an fp16 config); False where torch has no such query, as DeepSpeed reads it."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def composable_replicate():
    """``torch.distributed._composable.replicate`` (composable DDP; no public path yet)."""
    return importlib.import_module("torch.distributed._composable.replicate").replicate


def composable_fully_shard():
    """FSDP2's ``fully_shard``: public in ``torch.distributed.fsdp`` from torch 2.6, private before."""
    fsdp = importlib.import_module("torch.distributed.fsdp")
    if hasattr(fsdp, "fully_shard"):
        return fsdp.fully_shard
    return importlib.import_module("torch.distributed._composable.fsdp").fully_shard


def fsdp_flat_param(fsdp_module) -> torch.Tensor:
    """FSDP1: the one ``FlatParameter`` a wrapped module's parameters live in."""
    return fsdp_module._handle.flat_param


def fsdp_unflat_views(fsdp_module, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """FSDP1: ``flat`` (laid out like the flat parameter) split into the original
    parameters' views, by name. Inside ``no_sync()`` FSDP1 keeps the local *unsharded* flat
    gradient and offers no public way to split it (``summon_full_params(with_grads=True)``
    asserts the gradient is sharded)."""
    handle = fsdp_module._handle
    return dict(zip(handle.flat_param._fqns, handle._get_unflat_views(flat), strict=True))


# The one-line message when this torch lacks a feature that is not emulated (_torch_features).
features.warn_missing(torch.__version__, [
    _queue_callback, autograd_tls_has, autograd_tls_get, autograd_tls_stash, autograd_tls_remove,
    engine_run_backward])
