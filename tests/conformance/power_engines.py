"""Test engines for the oracle's power (tests/conformance/test_oracle_power.py): torch DDP with a
comm hook that does the averaging itself, correctly (`PlainHook`, the control) or with one
deliberate, rank-symmetric defect, so ranks stay bitwise identical and only the oracle can see it:

- `OneUlp`: one element of the first bucket one ulp up after the all-reduce;
- `Bf16Reduce`: the all-reduce done in bf16 instead of the gradients' fp32, cast back;
- `Scaled099`: every averaged gradient scaled by 0.99.

Every hook divides each rank's share by the world size first, as torch's `allreduce_hook` does.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def _hook(defect: str):
    def hook(group, bucket):
        buffer = bucket.buffer()
        tensor = buffer.to(torch.bfloat16) if defect == "bf16" else buffer
        tensor.div_(dist.get_world_size(group))
        work = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def done(fut):
            out = fut.value()[0]
            if defect == "bf16":
                buffer.copy_(out)
                out = buffer
            elif defect == "ulp" and bucket.index() == 0:
                out.view(-1)[0] = torch.nextafter(out.view(-1)[0], torch.tensor(float("inf"), dtype=out.dtype))
            elif defect == "scale":
                out.mul_(0.99)
            return out

        return work.then(done)

    return hook


class PlainHook(DistributedDataParallel):
    defect = ""

    def __init__(self, module, process_group=None, **kwargs):
        super().__init__(module, process_group=process_group, **kwargs)
        self.register_comm_hook(process_group, _hook(self.defect))


class OneUlp(PlainHook):
    defect = "ulp"


class Bf16Reduce(PlainHook):
    defect = "bf16"


class Scaled099(PlainHook):
    defect = "scale"
