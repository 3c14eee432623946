"""Adapters of the `dist_autograd` area: distributed autograd over `torch.distributed.rpc`.

The protocol (every method is called inside rank processes where RPC is up, workers named
`worker<rank>`)::

    class DistAutogradAdapter(Protocol):
        name: str; version: str; area = "dist_autograd"; capabilities: frozenset
        def context(self) -> ContextManager[int]: ...              # yields the context id
        def backward(self, context_id, roots, retain_graph=False): ...
        def get_gradients(self, context_id) -> dict[Tensor, Tensor]:   # on *this* worker
        def rpc_sync(self, to, fn, args): ...                      # recorded in the context
        def rpc_async(self, to, fn, args) -> Future: ...           # .wait() gives the value
        def remote(self, to, fn, args) -> RRef: ...  # the user then calls torch's rref.to_here()
        def debug_info(self) -> dict[str, int]:  # num_autograd_contexts, num_current_backward_passes
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from conformance.spec import Capability


class DistAutogradAdapter(Protocol):
    name: str
    version: str
    area: str
    capabilities: frozenset[Capability]

    def context(self) -> AbstractContextManager[int]: ...

    def backward(self, context_id: int, roots: list, retain_graph: bool = False) -> None: ...

    def get_gradients(self, context_id: int) -> dict: ...

    def rpc_sync(self, to: str, fn, args: tuple) -> Any: ...

    def rpc_async(self, to: str, fn, args: tuple) -> Any: ...

    def remote(self, to: str, fn, args: tuple) -> Any: ...

    def debug_info(self) -> dict[str, int]: ...


class RefimplDistAutograd:
    name = "refimpl-dist-autograd"
    area = "dist_autograd"
    capabilities: frozenset[Capability] = frozenset()

    def __init__(self):
        import refimpl

        self.version = getattr(refimpl, "__version__", "0")

    @property
    def _da(self):
        import refimpl.distributed_autograd as da

        return da

    def context(self):
        return self._da.context()

    def backward(self, context_id, roots, retain_graph=False):
        self._da.backward(context_id, roots, retain_graph=retain_graph)

    def get_gradients(self, context_id):
        return self._da.get_gradients(context_id)

    def rpc_sync(self, to, fn, args):
        return self._da.rpc_sync(to, fn, args=args)

    def rpc_async(self, to, fn, args):
        return self._da.rpc_async(to, fn, args=args)

    def remote(self, to, fn, args):
        return self._da.remote(to, fn, args=args)

    def debug_info(self):
        return {k: int(v) for k, v in self._da.debug_info().items()}


class TorchDistAutograd:
    name = "torch-dist-autograd"
    area = "dist_autograd"
    capabilities: frozenset[Capability] = frozenset()
    version = torch.__version__

    def context(self):
        import torch.distributed.autograd as da

        return da.context()

    def backward(self, context_id, roots, retain_graph=False):
        import torch.distributed.autograd as da

        da.backward(context_id, roots, retain_graph=retain_graph)

    def get_gradients(self, context_id):
        import torch.distributed.autograd as da

        return da.get_gradients(context_id)

    def rpc_sync(self, to, fn, args):
        from torch.distributed import rpc

        return rpc.rpc_sync(to, fn, args=args)

    def rpc_async(self, to, fn, args):
        from torch.distributed import rpc

        return rpc.rpc_async(to, fn, args=args)

    def remote(self, to, fn, args):
        from torch.distributed import rpc

        return rpc.remote(to, fn, args=args)

    def debug_info(self):
        from refimpl import _torch_compat as compat

        info = compat.dist_autograd_debug_info()  # strings; the only view of a worker's contexts
        return {k: int(info[k]) for k in ("num_autograd_contexts", "num_current_backward_passes") if k in info}


def refimpl_dist_autograd() -> RefimplDistAutograd:
    return RefimplDistAutograd()


def torch_dist_autograd() -> TorchDistAutograd:
    return TorchDistAutograd()


# -- a known-bad implementation: the tests prove the checks catch it ---------------------------
class LosesSecondSend(RefimplDistAutograd):
    """Mutant: the second RPC of every context sends its tensors detached, so the gradients
    flowing back through that send are lost (a send function never recorded)."""

    name = "mutant-dist-autograd-loses-send"
    _calls: dict[int, int] = {}
    _lock = threading.Lock()

    def rpc_sync(self, to, fn, args):
        cid = self._da.current_context_id()
        with self._lock:
            n = self._calls[cid] = self._calls.get(cid, 0) + 1
        if n == 2:
            args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        return super().rpc_sync(to, fn, args)


def mutant_loses_second_send() -> LosesSecondSend:
    return LosesSecondSend()


# -- issue 16: known-bad implementations of the failure classes torch's own tests found ---------
# Each is refimpl with one of the bugs refimpl had before issue 16 (or an equivalent one), and
# one issue-16 scenario catches it (tests/conformance/test_area_dist_autograd.py).
class _FetchesDetached:
    """An RRef whose to_here() is torch's plain fetch: no autograd edge, a detached copy."""

    def __init__(self, rref):
        self._rref = rref

    def to_here(self):
        from refimpl.distributed_autograd.rpc import _torch_to_here

        return _torch_to_here(self._rref)


class RRefFetchDetached(RefimplDistAutograd):
    """Mutant: RRef.to_here() inside a context returns a detached copy (refimpl before issue 16:
    a silent wrong gradient)."""

    name = "mutant-dist-autograd-rref-detached"

    def remote(self, to, fn, args):
        return _FetchesDetached(super().remote(to, fn, args))


class DensifiesSparseGrads(RefimplDistAutograd):
    """Mutant: sparse gradients come out of the context dense (a sparse leaf's gradient must
    stay sparse, as local autograd makes it)."""

    name = "mutant-dist-autograd-dense-sparse-grads"

    def get_gradients(self, context_id):
        return {t: (g.to_dense() if g.is_sparse else g) for t, g in super().get_gradients(context_id).items()}


class PicklesScriptTarget(RefimplDistAutograd):
    """Mutant: the RPC target travels by pickling, which a TorchScript function cannot."""

    name = "mutant-dist-autograd-pickles-script-target"

    def rpc_sync(self, to, fn, args):
        import functools

        return super().rpc_sync(to, functools.partial(fn), args)


class ForgetsTensorFreeWorkers(RefimplDistAutograd):
    """Mutant: a worker reached only by RPCs without tensors requiring grad is not remembered,
    so the context is never released there (refimpl before issue 16: a leak)."""

    name = "mutant-dist-autograd-forgets-tensor-free"

    def rpc_sync(self, to, fn, args):
        from torch.distributed import rpc

        from refimpl.distributed_autograd.context import current_context

        ctx = current_context()
        dst = rpc.get_worker_info(to).id
        with ctx.lock:
            known = dst in ctx.known_workers
        out = super().rpc_sync(to, fn, args)
        carried = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if not known and not carried:
            with ctx.lock:
                ctx.known_workers.discard(dst)
        return out


class _EnginePatch:
    """Swap one function of refimpl's local run (`refimpl.distributed_autograd.local_run`) while a
    backward runs (the local runs of this worker happen inside the call, on this thread or RPC
    threads of this process)."""

    _lock = threading.Lock()

    def __init__(self, name, value):
        self.name, self.value = name, value

    def __enter__(self):
        from refimpl.distributed_autograd import local_run

        self._lock.acquire()
        self.saved = getattr(local_run, self.name)
        setattr(local_run, self.name, self.value)

    def __exit__(self, *exc):
        from refimpl.distributed_autograd import local_run

        setattr(local_run, self.name, self.saved)
        self._lock.release()


class SharesGradBuffers(RefimplDistAutograd):
    """Mutant: captured gradients are stored as they come, so one tensor returned for two
    inputs becomes both leaves' buffer (refimpl before issue 16)."""

    name = "mutant-dist-autograd-shares-buffers"

    def backward(self, context_id, roots, retain_graph=False):
        with _EnginePatch("own_buffers", lambda grads: {t: g.detach() for t, g in grads.items()}):
            super().backward(context_id, roots, retain_graph)


def _run_local_grad_only(ctx, outputs, grad_outputs, retain_graph, later=None):
    """refimpl's local run before issue 16: torch.autograd.grad with the leaves and the received
    tensors as inputs, so AccumulateGrad nodes (and their post hooks) never execute. It adds
    the leaf gradients in at once (``later``, the engine's send-first list, stays empty)."""
    from collections import defaultdict

    from torch.autograd.graph import GradientEdge

    from refimpl.distributed_autograd import local_run
    from refimpl.distributed_autograd.functions import RecvBackward

    with ctx.run_lock:
        starts = [local_run.start_node(o) for o in outputs]  # root tensors or send edges
        leaves, _, _ = local_run.collect_leaves(starts)
        recvs, seen, stack = [], set(), list(starts)
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if isinstance(node, RecvBackward):
                recvs.append(node)
            else:
                stack.extend(n for n, _ in node.next_functions)
        # A received message's node has one output per tensor (its send ids, in order).
        received = [(n.origin, sid, GradientEdge(n, i)) for n in recvs for i, sid in enumerate(n.send_ids)]
        inputs = leaves + [edge for _, _, edge in received]
        if not inputs:
            return {}
        grads = torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph, allow_unused=True)
        with ctx.lock:
            owned = local_run.own_buffers({t: g for t, g in zip(leaves, grads, strict=False) if g is not None})
            for leaf, grad in owned.items():
                ctx.accumulate(leaf, grad)
    outbound = defaultdict(list)
    for (origin, send_id, _), grad in zip(received, grads[len(leaves):], strict=True):
        if grad is not None:
            outbound[origin].append((send_id, grad))
    return outbound


class SkipsAccumulateHooks(RefimplDistAutograd):
    """Mutant: leaf gradients are taken as inputs of torch.autograd.grad, so hooks registered on
    AccumulateGrad nodes never run (refimpl before issue 16)."""

    name = "mutant-dist-autograd-skips-accumulate-hooks"

    def backward(self, context_id, roots, retain_graph=False):
        with _EnginePatch("run_local", _run_local_grad_only):
            super().backward(context_id, roots, retain_graph)


def mutant_rref_detached() -> RRefFetchDetached:
    return RRefFetchDetached()


def mutant_dense_sparse_grads() -> DensifiesSparseGrads:
    return DensifiesSparseGrads()


def mutant_pickles_script_target() -> PicklesScriptTarget:
    return PicklesScriptTarget()


def mutant_forgets_tensor_free() -> ForgetsTensorFreeWorkers:
    return ForgetsTensorFreeWorkers()


def mutant_shares_buffers() -> SharesGradBuffers:
    return SharesGradBuffers()


def mutant_skips_accumulate_hooks() -> SkipsAccumulateHooks:
    return SkipsAccumulateHooks()
