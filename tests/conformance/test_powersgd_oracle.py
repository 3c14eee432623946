"""The PowerSGD oracle against torch's own hook in real 2-, 3- and 4-rank gloo worlds, and three broken hooks.

Each spawned world (loopback only) trains `ddp/plain/mlp/w<W>/fp32` for 5 steps under torch DDP with
each hook, through the adapter's wrapper (`PowerSGDWrapped`: torch's hook, and after training the
probe all-reduces that fix gloo's summation order at 3+ ranks). The oracle (`conformance.oracle.baseline`
with the declared `PowerSGDConfig` and the probe) must match torch's hooks bitwise at every step,
compressed steps included, and must reject a hook that zeroes the gradients after the warm-up, one
that sums without dividing, and one that stops communicating.
"""

from __future__ import annotations

import io
import socket

import pytest
import torch
import torch.multiprocessing as mp

from conformance import catalogue
from conformance.adapters.engines.powersgd import PowerSGDWrapped
from conformance.judge.compare import compare_dicts
from conformance.oracle.baseline import compute_anchored
from conformance.oracle.declared.ddp_buckets import bucket_layout, ready_order
from conformance.oracle.declared.powersgd_oracle import PowerSGDConfig
from conformance.oracle.envelope import reference
from conformance.semantics import Semantics

WORLDS = (2, 3, 4)
STEPS = 5
START = 2
VARIANTS = {
    "powerSGD_hook": PowerSGDConfig(start_powerSGD_iter=START),
    "fp16_compress_wrapper": PowerSGDConfig(start_powerSGD_iter=START, compress="float16"),
    "bf16_compress_wrapper": PowerSGDConfig(start_powerSGD_iter=START, compress="bfloat16"),
    "batch_tensors_with_same_shape": PowerSGDConfig(start_powerSGD_iter=START, batch_tensors_with_same_shape=True),
    "rank 2, no warm start": PowerSGDConfig(start_powerSGD_iter=START, matrix_approximation_rank=2, warm_start=False),
}
# bf16_compress_wrapper: DDP's register_comm_hook refuses a hook *named* bf16_compress_hook or
# bf16_compress_wrapper_hook unless CUDA 11+ with NCCL 2.10+ (or XPU with XCCL) is present
# (DistributedDataParallel._check_comm_hook, TypeError "BF16 all reduce communication hook required
# CUDA 11+ and NCCL 2.10+"): older NCCL has no bf16 all-reduce. The check is by __name__ only; gloo
# all-reduces bf16 on CPU, so here torch's own bf16_compress_wrapper(powerSGD_hook) runs unchanged
# inside the adapter's noting wrapper (another name), and the oracle must match it bitwise too.
MUTANTS = ("zeros after warm-up", "no division", "no communication after warm-up")
BATCHED = "batched_powerSGD_hook"  # torch 2.13's raises at its first compressed step (docs/findings)
BATCHED_CFG = PowerSGDConfig(start_powerSGD_iter=START, batched_hook=True)


def _scenario(world_size: int):
    wanted = f"ddp/plain/mlp/w{world_size}/fp32"
    return next(s for s in catalogue.select(profile="full") if s.id == wanted).with_(steps=STEPS)


def _hook(name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    if name == "fp16_compress_wrapper":
        return default_hooks.fp16_compress_wrapper(ps.powerSGD_hook)
    if name == "bf16_compress_wrapper":
        return default_hooks.bf16_compress_wrapper(ps.powerSGD_hook)
    if name == BATCHED:
        return ps.batched_powerSGD_hook
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
            if name == "no division":  # the sum, not the average
                return out.then(lambda f: f.value().mul_(torch.distributed.get_world_size()))
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


def _train(rank, world_size, port, queue):
    from types import SimpleNamespace

    import torch.distributed as dist

    from conformance.models.data import build_model, loss_fn, make_inputs, make_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    s = _scenario(world_size)
    ctx = SimpleNamespace(rank=rank, world_size=world_size, group=dist.group.WORLD, device=torch.device("cpu"))
    out = {}
    for name in (*VARIANTS, *MUTANTS, BATCHED):  # the batched hook last: it raises (before any collective)
        cfg = BATCHED_CFG if name == BATCHED else VARIANTS.get(name, VARIANTS["powerSGD_hook"])
        model = build_model(s.model, s.kwargs(), seed=s.seed, rank=rank, dtype=s.dtype, device="cpu", exact=s.exact_data)
        wrapped = PowerSGDWrapped(torch.nn.parallel.DistributedDataParallel(model), ctx, cfg)
        ddp = wrapped.ddp
        ddp.register_comm_hook(_state(None, cfg), wrapped.hook(_hook(name)))
        opt = make_optimizer(s.optimizer, ddp.parameters())
        grads = []
        for step in range(s.steps):
            (x,) = make_inputs(s.model, seed=s.seed, rank=rank, step=step, micro=0, size=s.shard_size(rank),
                               dtype=s.dtype, device="cpu")
            try:
                loss_fn(ddp(x, rank=rank, micro=0)).backward()
            except AssertionError:  # only the batched hook may: torch 2.13's _orthogonalize of its 2-D Q
                if name != BATCHED:
                    raise
                grads.append(None)
                break
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = (grads, wrapped.allreduce_probe())  # the probe: collective, after training (as the runners)
    buf = io.BytesIO()  # bytes, not shared-memory tensors: this process exits next
    torch.save(out, buf)
    queue.put((rank, buf.getvalue()))
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"w{w}")
def torch_runs(request):
    world_size = request.param
    with socket.socket() as sock:  # a free loopback port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_train, args=(r, world_size, port, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {r: torch.load(io.BytesIO(data)) for r, data in (queue.get(timeout=300) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    return world_size, results


def _expected(world_size, cfg, probed=None):
    """The oracle's synced gradients at every step, from the seeds (no anchor), with the ranks' probe."""
    s = _scenario(world_size)
    events = compute_anchored(s, Semantics(communication=cfg), {0: {"allreduce_probe": probed}}).events
    return [e.per_rank[0] for e in events if e.kind == "backward"]


def test_the_scenario_compresses_every_weight_after_the_warm_up():
    s = _scenario(2)
    named = [(n, torch.empty(shape)) for n, shape in
             (("layers.0.weight", (16, 8)), ("layers.0.bias", (16,)), ("layers.1.weight", (16, 16)),
              ("layers.1.bias", (16,)), ("layers.2.weight", (4, 16)), ("layers.2.bias", (4,)))]
    # DDP's rebuilt bucket: one bucket, in the order the gradients became ready (last layer first).
    assert bucket_layout(s, named, ready_order(s)) == [[n for n, _ in reversed(named)]]
    for rows, cols in ((16, 8), (16, 16), (4, 16)):  # torch's _should_compress at rank 1, rate 2
        assert (rows + cols) * 2 < rows * cols


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_oracle_is_bitwise_torchs_hook(torch_runs, name):
    world_size, runs = torch_runs
    expected = _expected(world_size, VARIANTS[name], runs[0][name][1])
    for rank in range(world_size):
        for step, (want, got) in enumerate(zip(expected, runs[rank][name][0], strict=True)):
            for n in want:
                # NaN where torch has NaN: in fp16 this scenario's compressed steps overflow (P's norm
                # exceeds 65504), in torch's hook and in the oracle alike, element for element.
                assert torch.equal(want[n].nan_to_num(), got[n].nan_to_num()) and torch.equal(
                    want[n].isnan(), got[n].isnan()), (name, rank, step, n, (want[n] - got[n]).abs().max().item())
    plain = _expected(world_size, None)[START]  # the plain average (at 3+ ranks an envelope: its rank-order value)
    compressed = [n for n in expected[START] if not torch.equal(expected[START][n], reference(plain[n]))]
    assert compressed, "the compressed step must differ from the plain average"


def test_at_3_ranks_the_probed_order_is_what_makes_it_bitwise(torch_runs):
    """Negative control: the same simulation adding in rank order (every length's probe replaced by
    one that reads rank order) is not torch's hook: without the probe the check would be a guess."""
    from conformance.oracle.allreduce_order import probe_values

    world_size, runs = torch_runs
    if world_size == 2:
        pytest.skip("a sum of two terms has one order")
    probed = runs[0]["powerSGD_hook"][1]
    in_rank_order = {}
    for (n, dtype), _ in probed.items():
        reads = [probe_values(r, world_size, n, getattr(torch, dtype)) for r in range(world_size)]
        sums = []
        for k in range(len(reads[0])):
            total = reads[0][k].clone()
            for r in range(1, world_size):
                total += reads[r][k]
            sums.append(total)
        in_rank_order[(n, dtype)] = torch.stack([torch.stack(sums)] * 2)
    guessed = _expected(world_size, VARIANTS["powerSGD_hook"], in_rank_order)
    got = runs[0]["powerSGD_hook"][0]
    assert any(not torch.equal(guessed[step][n], got[step][n]) for step in range(START, STEPS) for n in got[step])


def test_batched_hook_matches_through_the_warm_up_and_raises_where_it_compresses(torch_runs):
    """torch 2.13's batched_powerSGD_hook passes a 2-D Q to _orthogonalize, which asserts 3-D
    (docs/findings/powersgd-batched-hook.md): the warm-up steps are judged bitwise against the
    simulation; the first compressed step must still raise. When torch fixes the hook this test
    fails: then judge its compressed steps against the simulation (`PowerSGDConfig(batched_hook=True)`)."""
    world_size, runs = torch_runs
    grads, probed = runs[0][BATCHED]
    assert len(grads) == START + 1 and grads[START] is None, "torch's batched hook no longer raises at its first compressed step"
    expected = _expected(world_size, BATCHED_CFG, probed)
    for step in range(START):
        for n, want in expected[step].items():
            assert torch.equal(want, grads[step][n]), (step, n)


@pytest.mark.parametrize("name", MUTANTS)
def test_a_broken_hook_fails(torch_runs, name):
    world_size, runs = torch_runs
    cfg = VARIANTS["powerSGD_hook"]
    expected = _expected(world_size, cfg, runs[0][name][1])
    bad = [step for step, (want, got) in enumerate(zip(expected, runs[0][name][0], strict=True))
           if compare_dicts(want, got, cfg.rule())]
    assert bad, f"{name}: no step differs from the oracle"
    assert bad[0] <= START  # caught at the first compressed step (or before: no division)



LAYOUT_SCENARIOS = ("ddp/plain/transformer/w2/fp32", "ddp/static-graph/transformer/w3/fp32",
                    "ddp/autocast-bf16/transformer/w3/fp32", "ddp/ckpt-reentrant-static/ckpt-mlp/w4/fp32",
                    "ddp/bucket-tiny/transformer/w2/fp32", "ddp/unused-static-graph/branches/w2/fp32")


def _buckets_torch_reduces(port, queue):
    """torch DDP's buckets as a comm hook sees them, 3 iterations per scenario (a 1-rank world)."""
    import torch.distributed as dist

    from conformance.features import Features, autocast, model_kwargs
    from conformance.models.data import build_model, loss_fn, make_inputs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    out = {}
    for sid in LAYOUT_SCENARIOS:
        s = next(x for x in catalogue.select(profile="full") if x.id == sid)
        feats = Features.of(s)
        model = build_model(s.model, model_kwargs(s, feats, oracle=False), seed=s.seed, rank=0, dtype=s.dtype,
                            device="cpu", exact=s.exact_data)
        names = {id(p): n for n, p in model.named_parameters()}
        o = s.options
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, static_graph=o.static_graph, find_unused_parameters=o.find_unused_parameters,
            **({"bucket_cap_mb": o.bucket_cap_mb} if o.bucket_cap_mb is not None else {}))
        seen, it = [], [0]

        def hook(_, bucket, seen=seen, it=it, names=names):
            seen.append((it[0], bucket.index(), [names[id(p)] for p in bucket.parameters()]))
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, hook)
        for step in range(3):
            it[0] = step
            (x,) = make_inputs(s.model, seed=s.seed, rank=0, step=step, micro=0, size=s.shard_size(0), dtype=s.dtype,
                               device="cpu")
            with autocast(feats, "cpu"):
                loss = loss_fn(ddp(x, rank=0, micro=0))
            loss.backward()
        out[sid] = seen
    queue.put(out)
    dist.destroy_process_group()


def test_the_simulated_buckets_are_the_ones_torch_ddp_reduces():
    """Every iteration's bucket layout (before and after the rebuild; static_graph rebuilds one
    iteration later; autocast changes the ready order), against the buckets torch's hook receives.
    At 2 ranks a wrong layout hides (the sum is element-wise and order-free); at 3 it does not."""
    from conformance.oracle.declared.powersgd_oracle import PowerSGDSimulator

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_buckets_torch_reduces, args=(port, queue))
    proc.start()
    seen = queue.get(timeout=300)
    proc.join(timeout=60)
    for sid, buckets in seen.items():
        s = next(x for x in catalogue.select(profile="full") if x.id == sid).with_(world_size=2)
        from conformance.features import Features, model_kwargs
        from conformance.models.data import build_model

        model = build_model(s.model, model_kwargs(s, Features.of(s), oracle=True), seed=s.seed, rank=0, dtype=s.dtype,
                            device="cpu", exact=s.exact_data)
        sim = PowerSGDSimulator(VARIANTS["powerSGD_hook"], s, [(n, p) for n, p in model.named_parameters()])
        for iteration, index, names in buckets:
            layout = sim.initial if iteration < sim.rebuild_at else sim.buckets
            assert names == layout[index], (sid, iteration, index)


def test_at_3_ranks_without_a_probe_the_oracle_refuses_to_judge():
    """No rank-order guess: a record without the probe is an infrastructure error, never a verdict."""
    from conformance.judge.failure import FailureClass, classify_exception
    from conformance.oracle.allreduce_order import OrderUnknown, discover
    from conformance.oracle.declared.powersgd_oracle import PowerSGDSimulator

    s = _scenario(3)
    named = [(n, torch.empty(shape)) for n, shape in (("layers.0.weight", (16, 8)), ("layers.0.bias", (16,)))]
    with pytest.raises(ValueError, match="needs the backend's summation order") as refused:
        PowerSGDSimulator(VARIANTS["powerSGD_hook"], s, named, None)
    assert classify_exception(refused.value).failure_class == FailureClass.INFRASTRUCTURE
    with pytest.raises(OrderUnknown) as unknown:  # two probe runs that disagree: timing-dependent order
        discover(3, 2, torch.stack([torch.zeros(9, 2), torch.ones(9, 2)]))
    assert classify_exception(unknown.value).failure_class == FailureClass.INFRASTRUCTURE
