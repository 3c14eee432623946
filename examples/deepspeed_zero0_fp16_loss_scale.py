"""DeepSpeed without ZeRO (stage 0) in fp16: the update is divided by a loss scale that was never applied.

Standalone (torch + deepspeed 0.19, CPU, one process, a gloo group on a file store, no network):

    DS_BUILD_OPS=0 python examples/deepspeed_zero0_fp16_loss_scale.py

One fp16 linear layer, plain SGD (lr 1), DeepSpeed's documented loop (`engine.backward(loss)`,
`engine.step()`), config `fp16` with a dynamic loss scale starting at 2**7. The parameter should
move by exactly its gradient; it moves by gradient / 128. `engine.backward` calls the optimizer's
`scale_if_loss` only for ZeRO optimizers, so FP16_Optimizer (stage 0) never scales the loss, yet
its `step()` divides the gradients by the loss scale (`unscale_and_clip_grads`). With DeepSpeed's
default initial scale (2**16) every update is 65536 times too small, and nothing reports it.
See docs/findings/deepspeed-zero0-fp16-loss-scale.md.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile

import torch
import torch.distributed as dist


def main() -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    store = tempfile.NamedTemporaryFile(delete=False).name  # noqa: SIM115 - a file store, removed below
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
              "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 7, "hysteresis": 1},
              "zero_optimization": {"stage": 0}}
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    x = torch.tensor([[1.0, 2.0, 0.5, -1.0]], dtype=torch.float16)
    before = model.weight.detach().float().clone()
    loss = engine(x).sum()
    engine.backward(loss)
    grad = model.weight.grad.detach().float().clone()  # d(sum(w·x))/dw = x: what backward left
    engine.step()
    moved = before - model.weight.detach().float()
    print(f"gradient after engine.backward: {grad.tolist()}  (x = {x.float().tolist()}: the loss was not scaled)")
    print(f"update applied by engine.step(): {moved.tolist()}")
    print(f"update / gradient: {(moved / grad).tolist()}  -> expected 1.0 (lr 1); 1/128 means divided by the "
          "loss scale that was never applied")
    dist.destroy_process_group()
    os.unlink(store)


if __name__ == "__main__":
    main()
