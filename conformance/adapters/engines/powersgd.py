"""`torch-ddp-powersgd`: torch DDP with the PowerSGD comm hook (a stateful, lossy hook).

PowerSGD runs plain all-reduce for `start_powerSGD_iter` steps, then compresses every matrix
gradient that passes `min_compression_rate` to rank-r factors P, Q with error feedback and a
warm-started Q. The adapter runs torch's defaults (rank 1, error feedback, warm start, seed 0)
with the smallest warm-up torch allows (2), so most scenarios run compressed steps.

Declared: lossy communication, simulated exactly. The oracle runs torch's algorithm over the
ranks' own gradients (`conformance.powersgd_oracle`: DDP's rebuilt bucket layout, per-rank error
buffers, the same Q seed and orthogonalization), so the engine must match it bitwise at 2 ranks
(a sum of two terms has one order); scenarios of 3+ ranks are skipped with that reason (the
backend's sum order of P, Q and the uncompressed part has no derived envelope yet). A hook that zeroes, skips the division or stops communicating
after the warm-up fails (tests/conformance/test_powersgd_oracle.py).
"""

from __future__ import annotations

import torch

from conformance.adapters.ddp_like import DDP_CAPABILITIES, DDPLikeAdapter, DDPLikeWrapped
from conformance.powersgd_oracle import PowerSGDConfig
from conformance.semantics import Semantics
from conformance.spec import Capability as C

START_ITER = 2  # the smallest torch allows with error feedback / warm start: compression from step 2
CONFIG = PowerSGDConfig(start_powerSGD_iter=START_ITER)  # otherwise torch's defaults: rank 1, error feedback, warm start
SEMANTICS = Semantics(
    communication=CONFIG,
    sources=("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook: 'vanilla allreduce runs "
             "prior to step start_powerSGD_iter', then a lossy rank-r compression with error feedback",),
)


class PowerSGDAdapter(DDPLikeAdapter):
    semantics = SEMANTICS

    def __init__(self):
        from torch.nn.parallel import DistributedDataParallel

        super().__init__("torch-ddp-powersgd", DistributedDataParallel, version=torch.__version__,
                         capabilities=DDP_CAPABILITIES - {C.COMM_HOOK, C.SPARSE, C.JOIN, C.MIXED_PRECISION})

    def unavailable(self, scenario) -> str | None:
        feats = dict(scenario.features)
        if feats.get("freeze"):
            return "requires_grad toggles change DDP's buckets mid-run: the simulated bucket layout is fixed"
        if feats.get("compile"):
            return ("under torch.compile, DDPOptimizer splits the graph at its own bucket boundaries: the hook sees "
                    "buckets the simulation does not model")
        if feats.get("save_load_at") is not None:
            return ("PowerSGDState (error buffers, Q, iteration) is checkpointed apart from DDP's state_dict "
                    "(torch: PowerSGDState.__getstate__); the round trip here saves DDP's state_dict only")
        if scenario.world_size > 2:
            return ("the PowerSGD simulation is exact at 2 ranks; beyond, the backend's summation order of P, Q and "
                    "the uncompressed part feeds the orthogonalization and no derived envelope exists yet")
        if scenario.dtype in ("float16", "bfloat16", "float64"):
            return "the simulated hook is modelled for fp32 gradients"
        return None

    def wrap(self, module, ctx, options, optimizer=None) -> DDPLikeWrapped:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        wrapped = super().wrap(module, ctx, options)
        c = CONFIG
        state = powersgd.PowerSGDState(
            process_group=ctx.group, matrix_approximation_rank=c.matrix_approximation_rank,
            start_powerSGD_iter=c.start_powerSGD_iter, min_compression_rate=c.min_compression_rate,
            use_error_feedback=c.use_error_feedback, warm_start=c.warm_start, random_seed=c.random_seed,
        )
        wrapped.ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        return wrapped


def torch_ddp_powersgd() -> PowerSGDAdapter:
    return PowerSGDAdapter()
