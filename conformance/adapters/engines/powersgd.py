"""`torch-ddp-powersgd`: torch DDP with the PowerSGD comm hook (a stateful, lossy hook).

PowerSGD runs plain all-reduce for `start_powerSGD_iter` steps, then compresses every matrix
gradient that passes `min_compression_rate` to rank-r factors P, Q with error feedback and a
warm-started Q. The adapter runs torch's defaults (rank 1, error feedback, warm start, seed 0)
with the smallest warm-up torch allows (2), so most scenarios run compressed steps.

Declared: lossy communication, simulated exactly. The oracle runs torch's algorithm over the
ranks' own gradients (`conformance.oracle.declared.powersgd_oracle`: DDP's rebuilt bucket layout, per-rank error
buffers, the same Q seed and orthogonalization), so the engine must match it bitwise. At 3+ ranks
the backend's order of adding the ranks' P, Q and uncompressed part matters (the orthogonalization
carries its last bit everywhere), so after training every rank runs `allreduce_probe()` on the
engine's own process group: crafted all-reduces of every length the hook reduced
(`conformance.oracle.allreduce_order`) whose results fix, per element, the order gloo adds in; the
oracle replays that order, bitwise. The hook registered is torch's `powerSGD_hook`, called
unchanged by a wrapper that only notes each bucket's parameter shapes (which lengths to probe).
A hook that zeroes, skips the division or stops communicating after the warm-up fails
(tests/conformance/test_powersgd_oracle.py, at 2 and 3 ranks).
"""

from __future__ import annotations

import torch

from conformance.adapters.ddp_like import DDP_CAPABILITIES, DDPLikeAdapter, DDPLikeWrapped
from conformance.oracle.declared.powersgd_oracle import PowerSGDConfig
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
        wrapped = PowerSGDWrapped(wrapped.ddp, ctx, c)
        wrapped.ddp.register_comm_hook(state, wrapped.hook(powersgd.powerSGD_hook))
        return wrapped


class PowerSGDWrapped(DDPLikeWrapped):
    """DDP with the hook; notes the buckets it reduced so `allreduce_probe` knows the lengths."""

    def __init__(self, ddp, ctx, cfg: PowerSGDConfig = CONFIG):
        super().__init__(ddp)
        self.ctx, self.cfg = ctx, cfg
        self.buckets: set[tuple[tuple[int, ...], ...]] = set()
        self.dtype = torch.float32

    def hook(self, inner):
        def noting(state, bucket):
            self.buckets.add(tuple(tuple(p.shape) for p in bucket.parameters()))
            self.dtype = bucket.buffer().dtype
            return inner(state, bucket)

        return noting

    def allreduce_probe(self) -> dict | None:
        """Collective, after training: the probes of every length the hook all-reduced (None at <= 2 ranks,
        where a sum has one order). The oracle derives gloo's per-element order from them."""
        from conformance.oracle.allreduce_order import probe

        if self.ctx.world_size <= 2:
            return None
        sizes = self.cfg.allreduce_sizes([list(b) for b in sorted(self.buckets)], self.dtype)
        return probe(self.ctx.group, self.ctx.world_size, self.ctx.rank, sizes, device=self.ctx.device)


def torch_ddp_powersgd() -> PowerSGDAdapter:
    return PowerSGDAdapter()
