"""The PowerSGD oracle against torch's own hook in a real 2-rank gloo world, and three broken hooks.

One spawned world (loopback only) trains `ddp/plain/mlp/w2/fp32` for 5 steps under torch DDP with
each hook; the oracle (`conformance.baseline` with the declared `PowerSGDConfig`) must match torch's
hooks bitwise at every step, compressed steps included, and must reject a hook that zeroes the
gradients after the warm-up, one that sums without dividing, and one that stops communicating.
"""

from __future__ import annotations

import io
import socket

import pytest
import torch
import torch.multiprocessing as mp

from conformance import catalogue
from conformance.baseline import compute
from conformance.compare import compare_dicts
from conformance.powersgd_oracle import PowerSGDConfig, bucket_layout, ready_order
from conformance.semantics import Semantics

SCENARIO_ID = "ddp/plain/mlp/w2/fp32"
STEPS = 5
START = 2
VARIANTS = {
    "powerSGD_hook": PowerSGDConfig(start_powerSGD_iter=START),
    "fp16_compress_wrapper": PowerSGDConfig(start_powerSGD_iter=START, compress="float16"),
    "batch_tensors_with_same_shape": PowerSGDConfig(start_powerSGD_iter=START, batch_tensors_with_same_shape=True),
    "rank 2, no warm start": PowerSGDConfig(start_powerSGD_iter=START, matrix_approximation_rank=2, warm_start=False),
}
# bf16_compress_wrapper: DDP refuses it without CUDA 11+/NCCL 2.10+ (register_comm_hook raises on CPU);
# the simulation's bf16 path is the fp16 one with the other dtype.
MUTANTS = ("zeros after warm-up", "no division", "no communication after warm-up")


def _scenario():
    return next(s for s in catalogue.select(profile="standard") if s.id == SCENARIO_ID).with_(steps=STEPS)


def _hook(name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    if name == "fp16_compress_wrapper":
        return default_hooks.fp16_compress_wrapper(ps.powerSGD_hook)
    if name in MUTANTS:
        def mutant(state, bucket):
            compressing = state.iter >= state.start_powerSGD_iter
            if name == "no communication after warm-up" and compressing:
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
                return fut
            out = ps.powerSGD_hook(state, bucket)
            if name == "zeros after warm-up" and compressing:
                return out.then(lambda f: f.value().zero_())
            if name == "no division":
                return out.then(lambda f: f.value().mul_(2))
            return out
        return mutant
    return ps.powerSGD_hook


def _state(group, cfg: PowerSGDConfig):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    return ps.PowerSGDState(
        process_group=group, matrix_approximation_rank=cfg.matrix_approximation_rank,
        start_powerSGD_iter=cfg.start_powerSGD_iter, use_error_feedback=cfg.use_error_feedback,
        warm_start=cfg.warm_start, random_seed=cfg.random_seed,
        batch_tensors_with_same_shape=cfg.batch_tensors_with_same_shape,
    )


def _train(rank, port, queue):
    import torch.distributed as dist

    from conformance.models.data import build_model, loss_fn, make_inputs, make_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    s = _scenario()
    out = {}
    for name in (*VARIANTS, *MUTANTS):
        cfg = VARIANTS.get(name, VARIANTS["powerSGD_hook"])
        model = build_model(s.model, s.kwargs(), seed=s.seed, rank=rank, dtype=s.dtype, device="cpu", exact=s.exact_data)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(_state(None, cfg), _hook(name))
        opt = make_optimizer(s.optimizer, ddp.parameters())
        grads = []
        for step in range(s.steps):
            (x,) = make_inputs(s.model, seed=s.seed, rank=rank, step=step, micro=0, size=s.shard_size(rank),
                               dtype=s.dtype, device="cpu")
            loss_fn(ddp(x, rank=rank, micro=0)).backward()
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = grads
    buf = io.BytesIO()  # bytes, not shared-memory tensors: this process exits next
    torch.save(out, buf)
    queue.put((rank, buf.getvalue()))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def torch_runs():
    with socket.socket() as sock:  # a free loopback port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_train, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {r: torch.load(io.BytesIO(data)) for r, data in (queue.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    return results


def _expected(cfg):
    return [e.per_rank[0] for e in compute(_scenario(), Semantics(communication=cfg)).events if e.kind == "backward"]


def test_the_scenario_compresses_every_weight_after_the_warm_up():
    s = _scenario()
    named = [(n, torch.empty(shape)) for n, shape in
             (("layers.0.weight", (16, 8)), ("layers.0.bias", (16,)), ("layers.1.weight", (16, 16)),
              ("layers.1.bias", (16,)), ("layers.2.weight", (4, 16)), ("layers.2.bias", (4,)))]
    # DDP's rebuilt bucket: one bucket, in the order the gradients became ready (last layer first).
    assert bucket_layout(s, named, ready_order(s)) == [[n for n, _ in reversed(named)]]
    for rows, cols in ((16, 8), (16, 16), (4, 16)):  # torch's _should_compress at rank 1, rate 2
        assert (rows + cols) * 2 < rows * cols


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_oracle_is_bitwise_torchs_hook(torch_runs, name):
    expected = _expected(VARIANTS[name])
    for rank in range(2):
        for step, (want, got) in enumerate(zip(expected, torch_runs[rank][name], strict=True)):
            for n in want:
                # NaN where torch has NaN: in fp16 this scenario's compressed steps overflow (P's norm
                # exceeds 65504), in torch's hook and in the oracle alike, element for element.
                assert torch.equal(want[n].nan_to_num(), got[n].nan_to_num()) and torch.equal(
                    want[n].isnan(), got[n].isnan()), (name, rank, step, n, (want[n] - got[n]).abs().max().item())
    compressed = [n for n in expected[START] if not torch.equal(expected[START][n], _expected(None)[START][n])]
    assert compressed, "the compressed step must differ from the plain average"


@pytest.mark.parametrize("name", MUTANTS)
def test_a_broken_hook_fails(torch_runs, name):
    s = _scenario()
    expected = _expected(VARIANTS["powerSGD_hook"])
    bad = [step for step, (want, got) in enumerate(zip(expected, torch_runs[0][name], strict=True))
           if compare_dicts(want, got, s.tolerance)]
    assert bad, f"{name}: no step differs from the oracle"
    assert bad[0] <= START  # caught at the first compressed step (or before: no division)

