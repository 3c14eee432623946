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

