"""The distributed backward: gradients vs local autograd and torch.distributed.autograd,
root validation, retain_graph, errors and cleanup."""

from __future__ import annotations

import threading

import pytest
import torch

from refimpl.distributed_autograd.engine import validate_roots
from tests.refimpl.distributed_autograd import dist_autograd_cases as cases
from tests.refimpl.distributed_autograd.dist_autograd_cases import assert_grads, tensors
from tests.refimpl.distributed_autograd.dist_autograd_world import (
    channel_calls,
    wait_nothing_left,
    worker_name,
)


@pytest.mark.parametrize(
    "roots, match",
    [
        ([], "No tensors provided for gradient computation"),
        ([torch.rand(3, 3)], "requires_grad not set on root 0"),
        (
            [torch.rand(3, 3, requires_grad=True)],
            r"root 0 of shape \(3, 3\) is not a scalar, all roots need to be scalar",
        ),
        ([torch.rand(1, requires_grad=True)], "root 0 does not have a valid gradient function"),
    ],
)
def test_root_validation_messages(roots, match):
    with pytest.raises(RuntimeError, match=match):
        validate_roots(roots)


def test_root_validation_types():
    with pytest.raises(TypeError, match="list of scalar tensors"):
        validate_roots(None)
    with pytest.raises(TypeError, match="root 1 is a int"):
        validate_roots([(torch.ones(1, requires_grad=True) * 2).sum(), 3])
    good = (torch.ones(2, requires_grad=True) * 2).sum()
    assert validate_roots((good,)) == [good]


# ---------------------------------------------------------------------------------------------
def _check_backward(world_size):
    """Each part on the same world, then nothing left behind on any worker."""
    for part in (_compositions, _shapes, _retain_graph, _calls_and_debug_info, _two_threads):
        part()
    wait_nothing_left(world_size)


def _compositions():
    import torch.distributed.autograd as torch_dist_autograd

    import refimpl.distributed_autograd as dist_autograd

    # every composition: refimpl == local autograd == torch.distributed.autograd
    for seed, case in enumerate(cases.CASES):
        x, w = tensors(seed)
        expected = torch.autograd.grad(case("local", x, w), [x, w], allow_unused=True)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [case("refimpl", x, w)])
            assert_grads(case.__name__, dist_autograd.get_gradients(cid), [x, w], expected)
        assert x.grad is None and w.grad is None, f"{case.__name__}: wrote .grad"
        if case is not cases.unused_leaf:  # torch's FAST mode hangs on an unused send function
            with torch_dist_autograd.context() as cid:
                torch_dist_autograd.backward(cid, [case("torch", x, w)])
                assert_grads(
                    case.__name__ + "/torch",
                    torch_dist_autograd.get_gradients(cid),
                    [x, w],
                    expected,
                )


def _shapes():
    import refimpl.distributed_autograd as dist_autograd

    x, w = tensors(len(cases.CASES) - 1)  # (the last composition's tensors)
    # the answers of a fan-out reach the root's shared nodes together: they run once
    # (credit.py [Note: the root's own messages]), as under torch's engine, not once per answer
    expected = torch.autograd.grad(cases.counted_fan_out("local", x, w), [x, w])
    cases.COUNTED[0] = 0
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [cases.counted_fan_out("refimpl", x, w)])
        assert_grads("counted_fan_out", dist_autograd.get_gradients(cid), [x, w], expected)
    assert cases.COUNTED[0] == 1, f"the shared node ran {cases.COUNTED[0]} times"

    # several roots
    x, w = tensors(100)
    expected = torch.autograd.grad(cases.multi_roots("local", x, w), [x, w])
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, cases.multi_roots("refimpl", x, w))
        assert_grads("multi_roots", dist_autograd.get_gradients(cid), [x, w], expected)

    # a send function whose result is never used: the pass completes (no FAST-mode hang)
    with dist_autograd.context() as cid:
        dist_autograd.rpc_sync(worker_name(1), torch.add, args=(x, w))
        dist_autograd.backward(cid, [(x * w).sum()])
        assert_grads(
            "unused_send", dist_autograd.get_gradients(cid), [x, w], [w.detach(), x.detach()]
        )


def _retain_graph():
    import refimpl.distributed_autograd as dist_autograd

    x, w = tensors(100)
    # retain_graph: repeated backward accumulates in the context; then the graph is released
    expected = torch.autograd.grad(cases.chain("local", x, w), [x, w])
    with dist_autograd.context() as cid:
        loss = cases.chain("refimpl", x, w)
        for _ in range(3):
            dist_autograd.backward(cid, [loss], retain_graph=True)
        grads = dist_autograd.get_gradients(cid)
        assert_grads("retain_graph x3", grads, [x, w], [3 * e for e in expected])
        dist_autograd.backward(cid, [loss])  # 4th, frees the graph
        assert_grads(
            "retain_graph x4", dist_autograd.get_gradients(cid), [x, w], [4 * e for e in expected]
        )
        with pytest.raises(
            RuntimeError, match="backward through the distributed graph a second time"
        ):
            dist_autograd.backward(cid, [loss])
        # a fresh forward in the same context works again and keeps accumulating
        dist_autograd.backward(cid, [cases.chain("refimpl", x, w)])
        assert_grads(
            "after release", dist_autograd.get_gradients(cid), [x, w], [5 * e for e in expected]
        )


def _calls_and_debug_info():
    import refimpl.distributed_autograd as dist_autograd

    x, w = tensors(100)
    # rpc_async, remote + to_here, and an RRef passed to another call
    with dist_autograd.context() as cid:
        fut = dist_autograd.rpc_async(worker_name(2), torch.matmul, args=(x, w))
        a = fut.wait()
        rref = dist_autograd.remote(worker_name(1), torch.mul, args=(a, w))
        b = dist_autograd.to_here(rref)
        loss = (b * x).sum()
        dist_autograd.backward(cid, [loss])
        got = dist_autograd.get_gradients(cid)
    expected = torch.autograd.grad((((x @ w) * w) * x).sum(), [x, w])
    assert_grads("rpc_async/remote/to_here", got, [x, w], expected)

    # the pass is visible in the debug info of a worker while it runs there
    cases_probe = worker_name(1)
    with dist_autograd.context() as cid:
        y = dist_autograd.rpc_sync(cases_probe, cases.record_in_backward, args=(x,))
        dist_autograd.backward(cid, [y.sum()])
    seen = dist_autograd.rpc_sync(cases_probe, cases.recorded)
    assert seen == [{"num_current_backward_passes": 1, "num_autograd_contexts": 1}], seen


def _two_threads():
    import refimpl.distributed_autograd as dist_autograd

    # two threads, two contexts, backward concurrently through the same workers
    results, errors = {}, []

    def trainer(i):
        try:
            xi, wi = tensors(200 + i)
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [cases.fan_out("refimpl", xi, wi)])
                results[i] = (xi, wi, dist_autograd.get_gradients(cid))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(results) == 2, errors
    for xi, wi, got in results.values():
        assert_grads(
            "threads", got, [xi, wi], torch.autograd.grad(cases.fan_out("local", xi, wi), [xi, wi])
        )


@pytest.mark.slow
def test_backward_matches_local_and_torch(rpc_world):
    rpc_world.run(_check_backward)


# ---------------------------------------------------------------------------------------------
def _check_errors(world_size):
    import refimpl.distributed_autograd as dist_autograd

    x, w = tensors(7)

    # backward outside any context / with an unknown id
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 100"):
        dist_autograd.backward(100, [(x * w).sum()])
    with pytest.raises(TypeError, match="context_id must be an int"):
        dist_autograd.backward(None, [(x * w).sum()])

    # validation inside a context
    with dist_autograd.context() as cid:
        with pytest.raises(RuntimeError, match="No tensors provided"):
            dist_autograd.backward(cid, [])
        with pytest.raises(RuntimeError, match="is not a scalar"):
            dist_autograd.backward(cid, [x * w])

    # an error two hops away surfaces on the caller, naming the node
    with pytest.raises(RuntimeError, match="Error on Node 2: Simulate error on backward pass"):
        with dist_autograd.context() as cid:
            y = dist_autograd.rpc_sync(worker_name(1), cases.fail_deeper, args=(x * w,))
            dist_autograd.backward(cid, [y.sum()])
    wait_nothing_left(world_size)

    # an error on the caller itself is Node 0
    with dist_autograd.context() as cid:
        y = dist_autograd.rpc_sync(worker_name(1), torch.mul, args=(x, w))
        with pytest.raises(RuntimeError, match="Error on Node 0: Simulate error on backward pass"):
            dist_autograd.backward(cid, [cases.fail_in_backward(y).sum()])
        assert dist_autograd._get_debug_info()["num_current_backward_passes"] == 0
    wait_nothing_left(world_size)

    # with retain_graph, a failed pass can be followed by working passes in the same context
    with dist_autograd.context() as cid:
        y = dist_autograd.rpc_sync(worker_name(1), cases.fail_in_backward, args=(x,))
        z = dist_autograd.rpc_sync(worker_name(2), torch.mul, args=(x, w))
        for _ in range(2):
            with pytest.raises(RuntimeError, match="Error on Node 1"):
                dist_autograd.backward(cid, [y.sum()], retain_graph=True)
        dist_autograd.backward(cid, [z.sum()], retain_graph=True)
        got = dist_autograd.get_gradients(cid)
        torch.testing.assert_close(got[w], x.detach())
    wait_nothing_left(world_size)


@pytest.mark.slow
def test_errors_and_cleanup(rpc_world):
    rpc_world.run(_check_errors)


# ---------------------------------------------------------------------------------------------
def _check_fetch_by_key(world_size):
    """rpc.py [Note: fetch by key]: after the first fetch of an RRef in a context, later
    fetches send its key (over the channel once it is open) and still record the autograd edge;
    values that cannot be held weakly, and fetches with a timeout, take the RPC each time."""
    import time

    from torch.distributed import rpc

    import refimpl.distributed_autograd as dist_autograd
    from refimpl.distributed_autograd import rpc as rpc_mod

    owner = worker_name(1)
    rref = rpc.remote(owner, cases.leaf_ones, args=(3,))
    x = torch.tensor([1.0, 2.0, 3.0])
    deadline = time.monotonic() + 120
    used_channel = False
    for step in range(1000):
        with dist_autograd.context() as cid:
            before = channel_calls()
            value = rref.to_here() if step % 2 else dist_autograd.to_here(rref)
            fetched_on_channel = channel_calls() > before
            dist_autograd.backward(cid, [(value * x * (step + 1)).sum()])
            grad = rpc.rpc_sync(owner, cases.rref_value_grad, args=(rref, cid))
        torch.testing.assert_close(grad, x * (step + 1), msg=lambda m, step=step: f"fetch {step}: {m}")
        assert rpc_mod._key_of(rref) is not None, "the first fetch did not leave a key"
        used_channel |= fetched_on_channel
        if used_channel and step >= 3:
            break
        assert time.monotonic() < deadline, "no fetch by key ever used the channel"

    # one key per tensor, however many RRefs name it and however often they are fetched
    held = rpc.rpc_sync(owner, cases.keys_held)
    for rref_i in rpc.rpc_sync(owner, cases.rrefs_to_one_tensor, args=(4,)):
        for _ in range(2):
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [(rref_i.to_here() * x).sum()])
    assert rpc.rpc_sync(owner, cases.keys_held) == held + 1

    # the owner fetching its own RRef keeps no key
    mine = rpc.RRef(torch.ones(2, requires_grad=True))
    held = cases.keys_held()
    for _ in range(3):
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [mine.to_here().sum()])
            assert dist_autograd.get_gradients(cid)[mine.local_value()].tolist() == [1.0, 1.0]
    assert cases.keys_held() == held and rpc_mod._key_of(mine) is None

    listed = rpc.remote(owner, cases.leaf_list, args=(3,))
    for _ in range(3):
        with dist_autograd.context() as cid:
            (value,) = listed.to_here()
            dist_autograd.backward(cid, [(value * x).sum()])
            grads = rpc.rpc_sync(owner, dist_autograd.get_gradients, args=(cid,))
        assert [g.tolist() for g in grads.values()] == [x.tolist()], grads
        assert rpc_mod._key_of(listed) is None, "a list was given a key"

    with dist_autograd.context() as cid:
        before = channel_calls()
        value = rref.to_here(timeout=60)
        assert channel_calls() == before, "a fetch with a timeout went by key"
        dist_autograd.backward(cid, [(value * x).sum()])
        grad = rpc.rpc_sync(owner, cases.rref_value_grad, args=(rref, cid))
    torch.testing.assert_close(grad, x)
    wait_nothing_left(world_size)


@pytest.mark.slow
def test_to_here_fetches_by_key_and_records(rpc_world):
    rpc_world.run(_check_fetch_by_key)


def _check_profiler_scopes(world_size):
    """While the profiler records, a backward shows torch's scopes (engine.py [Note: profiler
    scopes]): the whole call, the recv node's run, and the run of the gradients received for
    this worker's send function; the backward's scope holds the others."""
    import refimpl.distributed_autograd as dist_autograd

    t1, t2 = torch.rand(3, 3, requires_grad=True), torch.rand(3, 3, requires_grad=True)
    with dist_autograd.context() as cid:
        loss = dist_autograd.rpc_sync(worker_name(1), torch.add, args=(t1, t2)).sum()
        with torch.autograd.profiler.profile() as prof:
            dist_autograd.backward(cid, [loss])
        grads = dist_autograd.get_gradients(cid)
    torch.testing.assert_close(grads[t1], torch.ones(3, 3))
    events = {}
    for e in prof.function_events:
        events.setdefault(e.name, []).append(e)
    names = ("backward", "RecvRpcBackward", "SendRpcBackward")
    found = {n: events.get(f"torch::distributed::autograd::{n}", []) for n in names}
    assert all(len(v) == 1 for v in found.values()), {n: len(v) for n, v in found.items()}
    whole = found["backward"][0].time_range
    for n in names[1:]:
        part = found[n][0].time_range
        assert whole.start <= part.start and part.end <= whole.end, (n, whole, part)
    wait_nothing_left(world_size)


@pytest.mark.slow
def test_profiler_scopes_are_torch_names(rpc_world):
    rpc_world.run(_check_profiler_scopes)
