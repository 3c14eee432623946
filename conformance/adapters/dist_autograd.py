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

    def debug_info(self):
        import torch.distributed.autograd as da

        info = da._get_debug_info()  # strings; the only public view of a worker's contexts
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
