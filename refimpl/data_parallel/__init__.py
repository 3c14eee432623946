"""Single-process data parallelism: replicate, scatter/gather, parallel_apply, data_parallel.

The behavioural reference is torch's `torch::nn::parallel` (C++) and
`torch.nn.parallel` (Python); this is an independent implementation with one code path for
CPU and GPU, so a list of CPU devices (`["cpu", "cpu"]`) works wherever GPUs would.

    from refimpl.data_parallel import data_parallel, DataParallel
    loss = data_parallel(model, (x,), devices=["cpu"] * 4).sum()
    loss.backward()                     # model.*.grad == grads of model(x).sum()

One module per concept: `devices` (normalisation, current device), `replicate`
(copies with reduce-add gradient edges), `scatter_gather` (autograd scatter / gather),
`parallel_apply` (threads, thread-local state, errors) and `forward` (the four steps
chained: the `data_parallel` function and the `DataParallel` module).

`refimpl.data_parallel` is this package; the function is `refimpl.data_parallel.data_parallel`
(as in torch, where `torch.nn.parallel.data_parallel` is the function).
"""

from .forward import DataParallel, data_parallel
from .parallel_apply import ReplicaError, parallel_apply
from .replicate import Broadcast, ReplicaInfo, ReplicaMisuseError, is_replica, replicate
from .scatter_gather import Gather, Scatter, balanced_chunk_sizes, gather, scatter, scatter_kwargs

__all__ = [
    "Broadcast",
    "DataParallel",
    "Gather",
    "ReplicaError",
    "ReplicaInfo",
    "ReplicaMisuseError",
    "Scatter",
    "balanced_chunk_sizes",
    "data_parallel",
    "gather",
    "is_replica",
    "parallel_apply",
    "replicate",
    "scatter",
    "scatter_kwargs",
]



# [Note: deprecated paths of 0.1.0]
# In refimpl 0.1.0 `refimpl.data_parallel.data_parallel` was the module holding the function,
# and the package was callable (`refimpl.data_parallel(model, inputs, devices)`), because
# `from refimpl import data_parallel` gave the function. Now that name is the function, as in
# torch. Until refimpl 0.3.0 both old forms keep working with a DeprecationWarning: calling the
# package calls the function, and the old module path imports from `sys.modules` (a file of
# that name would rebind this package's `data_parallel` to a module) and reads
# `refimpl.data_parallel.forward`.
import sys as _sys  # noqa: E402
import types as _types  # noqa: E402
import warnings as _warnings  # noqa: E402

from refimpl import _deprecated  # noqa: E402


class _CallablePackage(_types.ModuleType):
    def __call__(self, *args, **kwargs):
        _warnings.warn(
            "calling the package refimpl.data_parallel is deprecated and will be removed in refimpl "
            f"{_deprecated.REMOVED_IN}: call refimpl.data_parallel.data_parallel (the function)",
            DeprecationWarning, stacklevel=2,
        )
        return data_parallel(*args, **kwargs)


class _MovedModule(_types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        _warnings.warn(_deprecated.message(self.__name__), DeprecationWarning, stacklevel=2)
        from . import forward

        return getattr(forward, name)


_sys.modules[__name__].__class__ = _CallablePackage
_sys.modules.setdefault(
    __name__ + ".data_parallel",
    _MovedModule(__name__ + ".data_parallel", "Deprecated: moved to `refimpl.data_parallel.forward`."),
)
