"""Engine rules an adapter declares, which the oracle models exactly instead of bounding.

Some engines legitimately compute something other than torch DDP's average (DESIGN.md,
"Declared semantics"): lossy communication, their own clipping, their own loss scaling. An
adapter declares the rule; the oracle replays it op for op, and the report shows the
declaration beside the verdict:

- `powersgd_oracle`  torch's `powerSGD_hook` simulated over the ranks' gradients, on the
                     buckets torch DDP forms (`ddp_buckets`);
- `deepspeed_clip`   DeepSpeed's `gradient_clipping`, replayed on the averaged gradients;
- `loss_scaler`      a dynamic loss scaler (DeepSpeed's `fp16` config), step by step.
"""
