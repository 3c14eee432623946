"""Adapters written to earlier versions of the protocols, as their authors wrote them then.

They must keep passing every scenario they could always run (tests/conformance/test_protocol_versions.py):
a part the protocol gained later is detected on them, and only the scenarios that need it are
skipped, with the change to make.
"""

import torch
from torch.nn.parallel import DistributedDataParallel

from conformance.spec import Capability


class DataParallelBeforeKwargs:
    """The data_parallel protocol before `module_kwargs` (#30): five arguments, no optional hooks."""

    name = "old-data-parallel"
    area = "data_parallel"
    version = "1.0"
    capabilities = frozenset({Capability.HALF_PRECISION})

    def data_parallel(self, module, inputs, devices, output_device, dim):
        from refimpl.data_parallel import data_parallel

        return data_parallel(module, inputs, devices=devices, output_device=output_device, dim=dim)


class _WrappedV1:
    """Protocol v1's Wrapped: the six members, nothing optional (no zero_grad, close, probes, stats)."""

    def __init__(self, ddp):
        self.ddp, self.module = ddp, ddp.module

    def __call__(self, *inputs, **kwargs):
        return self.ddp(*inputs, **kwargs)

    def no_sync(self):
        return self.ddp.no_sync()

    def full_gradients(self):
        return {n: None if p.grad is None else p.grad.detach().clone() for n, p in self.module.named_parameters()}

    def full_parameters(self):
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def full_buffers(self):
        return {n: b.detach().clone() for n, b in self.module.named_buffers()}

    def optimizer_parameters(self):
        return list(self.module.parameters())


class DDPProtocolV1:
    """Protocol v1: `wrap(module, ctx, options)` only (no `optimizer=`, no owns, no semantics)."""

    name = "old-ddp"
    area = "ddp"
    version = torch.__version__
    capabilities = frozenset({Capability.NO_SYNC, Capability.FIND_UNUSED})

    def wrap(self, module, ctx, options):
        return _WrappedV1(DistributedDataParallel(module, process_group=ctx.group,
                                                  find_unused_parameters=options.find_unused_parameters))


class DDPOwnsOptimizerWithoutTheKeyword(DDPProtocolV1):
    """Declares that it owns the optimizer (v2) but its wrap() predates the `optimizer=` keyword."""

    name = "half-updated-ddp"
    owns = frozenset({"optimizer"})


def data_parallel_before_kwargs():
    return DataParallelBeforeKwargs()


def ddp_v1():
    return DDPProtocolV1()


def ddp_owns_optimizer_without_keyword():
    return DDPOwnsOptimizerWithoutTheKeyword()
