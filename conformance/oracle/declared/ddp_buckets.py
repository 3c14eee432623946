"""DDP's buckets as a communication hook sees them: which parameters, in which order.

A declared lossy hook (PowerSGD, `conformance.oracle.declared.powersgd_oracle`) works on whole
buckets, so simulating it needs torch DDP's bucket layout: the first iteration's (every
parameter in one bucket, in registration order, where the reducer rebuilds) and the rebuilt one
(by the order gradients became ready in rank 0's first backward, which autocast's casts change).
"""

from __future__ import annotations

from torch import Tensor


def bucket_layout(scenario, named: list[tuple[str, Tensor]], ready_order: list[str],
                  initial: bool = False) -> list[list[str]]:
    """DDP's buckets (parameter names, in bucket order) after the rebuild, as the reducer forms them;
    `initial`: iteration 0's, before it (one bucket of every parameter in registration order where
    the reducer rebuilds: a layout the element-wise sum hides at 2 ranks, not at 3 with gloo's order)."""
    import sys

    from refimpl._torch_compat import ddp_bucket_assignment, ddp_first_bucket_bytes

    opts = scenario.options
    default_cap = opts.bucket_cap_mb is None
    cap = int((25 if default_cap else opts.bucket_cap_mb) * 1024 * 1024)
    first = ddp_first_bucket_bytes() if default_cap else cap
    params = [p for _, p in named]
    names = [n for n, _ in named]
    rebuilds = opts.static_graph or not opts.find_unused_parameters
    if rebuilds and initial:
        buckets, _ = ddp_bucket_assignment(params, [sys.maxsize], [False] * len(params))
        buckets = list(reversed(buckets))
    elif rebuilds:
        index = {n: i for i, n in enumerate(names)}
        order = [n for n in ready_order if n in index] + [n for n in names if n not in ready_order]
        buckets, _ = ddp_bucket_assignment(
            [params[index[n]] for n in order], [first, cap], [False] * len(order), [index[n] for n in order])
    else:
        limits = [first, cap] if first < cap else [cap]
        buckets, _ = ddp_bucket_assignment(params, limits, [False] * len(params))
        buckets = list(reversed(buckets))
    return [[names[i] for i in bucket] for bucket in buckets]


def ready_order(scenario) -> list[str]:
    """The order rank 0's gradients become ready in its first backward (what DDP's rebuild records):
    the ranks' own model (checkpointing as asked) under the scenario's autocast, whose casts change
    the order (a weight's gradient before its bias's)."""
    from conformance.features import Features, autocast, model_kwargs
    from conformance.models.data import build_model, loss_fn, make_inputs

    feats = Features.of(scenario)
    model = build_model(scenario.model, model_kwargs(scenario, feats, oracle=False), seed=scenario.seed, rank=0,
                        dtype=scenario.dtype, device=scenario.device, exact=scenario.exact_data)
    order: list[str] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _p, name=name: order.append(name))
    (x,) = make_inputs(scenario.model, seed=scenario.seed, rank=0, step=0, micro=0, size=scenario.shard_size(0),
                       dtype=scenario.dtype, device=scenario.device)
    with autocast(feats, scenario.device):
        loss = loss_fn(model(x, rank=0, micro=0))
    if loss.requires_grad:
        loss.backward()
    return order
