"""`torch-ddp-powersgd`: torch DDP with the PowerSGD comm hook (a stateful, lossy hook).

PowerSGD runs plain all-reduce for `start_powerSGD_iter` steps, then compresses every matrix
gradient to rank-r factors with error feedback and warm-started Q. The adapter uses
`START_ITER = 3` (so the ≥10-step scenarios run well past the warm-up) and a rank as large as
any matrix dimension in the model zoo with `min_compression_rate=0`: every matrix gradient is
compressed, but at full rank, so the factorization is exact up to the rounding of the
orthogonalization. The declared bound is that rounding; a hook that loses state, drops the
error feedback or mis-scales anything is far outside it. Ranks must still be bitwise identical
(every rank all-reduces the same P and Q).
"""

from __future__ import annotations

import torch

from conformance.adapters.ddp_like import DDP_CAPABILITIES, DDPLikeAdapter, DDPLikeWrapped
from conformance.semantics import Semantics
from conformance.spec import Capability as C
from conformance.spec import Tolerance

START_ITER = 3
RANK = 64  # >= every matrix dimension in fixtures/models.py: full rank
ORTHO_EPS = 1e-6  # torch: "a small value added to every normalized matrix column ... to prevent div-by-zero"
BOUND = Tolerance(False, rtol=2.0**-12, atol=2.0**-12,
                  reason=f"PowerSGD at full rank (r={RANK}) after {START_ITER} plain steps: exact up to "
                         "the rounding of Gram-Schmidt orthogonalization (fp32)")
SEMANTICS = Semantics(
    lossy=BOUND,
    sources=("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook: 'vanilla allreduce runs "
             "prior to step start_powerSGD_iter'; a lossy low-rank compression afterwards",),
)


class PowerSGDAdapter(DDPLikeAdapter):
    semantics = SEMANTICS

    def __init__(self):
        from torch.nn.parallel import DistributedDataParallel

        super().__init__("torch-ddp-powersgd", DistributedDataParallel, version=torch.__version__,
                         capabilities=DDP_CAPABILITIES - {C.COMM_HOOK, C.SPARSE})

    def unavailable(self, scenario) -> str | None:
        if scenario.dtype in ("float16", "bfloat16", "float64"):
            return "PowerSGD's hook orthogonalizes in the gradient's dtype: the declared bound is for fp32 only"
        return None

    def wrap(self, module, ctx, options, optimizer=None) -> DDPLikeWrapped:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        wrapped = super().wrap(module, ctx, options)
        state = powersgd.PowerSGDState(
            process_group=ctx.group, matrix_approximation_rank=RANK, start_powerSGD_iter=START_ITER,
            min_compression_rate=0, use_error_feedback=True, warm_start=True, random_seed=0,
            orthogonalization_epsilon=ORTHO_EPS,
        )
        wrapped.ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        return wrapped


def torch_ddp_powersgd() -> PowerSGDAdapter:
    return PowerSGDAdapter()
