"""Contexts: ids, nesting, thread-locality, release on every worker."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from refimpl.distributed_autograd.context import ContextContainer
from tests.refimpl.distributed_autograd.dist_autograd_world import wait_nothing_left, worker_name


def test_ids_carry_worker_id_in_high_bits():
    cont = ContextContainer(worker_id=5)
    ids = [cont.new_context().context_id for _ in range(3)]
    assert [i >> 48 for i in ids] == [5, 5, 5], ids
    assert [i & ((1 << 48) - 1) for i in ids] == [0, 1, 2], ids
    assert cont.max_id() == (5 << 48) + 281474976710655
    assert cont.debug_info() == {"num_current_backward_passes": 0, "num_autograd_contexts": 3}


def test_retrieve_unknown_and_released():
    cont = ContextContainer(worker_id=1)
    ctx = cont.new_context()
    assert cont.retrieve(ctx.context_id) is ctx
    cont.pop(ctx.context_id)
    with pytest.raises(
        RuntimeError, match=f"Could not find autograd context with id: {ctx.context_id}"
    ):
        cont.retrieve(ctx.context_id)


def test_get_or_create_is_keyed_by_id_and_passes_are_counted():
    cont = ContextContainer(worker_id=2)
    remote_id = (7 << 48) | 3
    a = cont.get_or_create(remote_id)
    assert cont.get_or_create(remote_id) is a
    cont.pass_started(remote_id)
    cont.pass_started(remote_id)
    assert cont.debug_info()["num_current_backward_passes"] == 1
    cont.pass_finished(remote_id)
    cont.pass_finished(remote_id)
    assert cont.debug_info() == {"num_current_backward_passes": 0, "num_autograd_contexts": 1}


def test_worker_id_must_fit_16_bits():
    with pytest.raises(ValueError, match="16 bits"):
        ContextContainer(worker_id=1 << 16)


# ---------------------------------------------------------------------------------------------
def _remote_current_id():
    import refimpl.distributed_autograd as dist_autograd

    return dist_autograd.current_context_id()


def _check_contexts(world_size):
    import refimpl.distributed_autograd as dist_autograd
    from refimpl.distributed_autograd.context import _retrieve_context

    # ids, and release on exit
    ids = []
    for _ in range(5):
        with dist_autograd.context() as cid:
            assert cid >> 48 == 0, hex(cid)
            assert _retrieve_context(cid).context_id == cid
            assert dist_autograd.current_context_id() == cid
            ids.append(cid)
    assert ids == sorted(set(ids)), ids
    for cid in ids:
        with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {cid}"):
            dist_autograd.get_gradients(cid)

    # nesting is an error, and the outer context survives it
    with dist_autograd.context() as outer:
        with pytest.raises(
            RuntimeError, match="Already have an autograd context id for this thread"
        ):
            with dist_autograd.context():
                pass
        assert dist_autograd.current_context_id() == outer

    # thread-local: another thread has no current context, and can open its own
    seen = {}
    with dist_autograd.context() as mine:

        def other():
            try:
                dist_autograd.current_context_id()
            except RuntimeError as exc:
                seen["no_ctx"] = str(exc)
            with dist_autograd.context() as theirs:
                seen["theirs"] = theirs

        t = threading.Thread(target=other)
        t.start()
        t.join(10)
        assert not t.is_alive()
        assert "no distributed autograd context" in seen["no_ctx"]
        assert seen["theirs"] != mine
        assert dist_autograd.current_context_id() == mine

    # the callee runs inside the caller's context id; exit releases it there too
    x = torch.ones(2, requires_grad=True)
    with dist_autograd.context() as cid:
        assert dist_autograd.rpc_sync(worker_name(1), _remote_current_id) == cid
        dist_autograd.rpc_sync(worker_name(1), torch.mul, args=(x, 2))
        info = dist_autograd.rpc_sync(worker_name(1), dist_autograd._get_debug_info)
        assert info["num_autograd_contexts"] == 1, info
    wait_nothing_left(world_size)

    # outside a context the wrappers are plain RPCs
    y = dist_autograd.rpc_sync(worker_name(1), torch.mul, args=(x.detach(), 2))
    assert torch.equal(y, torch.full((2,), 2.0))


@pytest.mark.slow
def test_contexts_in_rpc_world(rpc_world):
    rpc_world.run(_check_contexts)


# ---------------------------------------------------------------------------------------------
def _check_new_release_and_max_id(world_size):
    import refimpl.distributed_autograd as dist_autograd
    from refimpl.distributed_autograd.context import current_context

    assert dist_autograd._get_max_id() == (0 << 48) + (1 << 48) - 1
    assert dist_autograd.rpc_sync(worker_name(1), dist_autograd._get_max_id) == (1 << 48) + (
        1 << 48
    ) - 1

    # _new_context makes the context the thread's current one; RPCs record in it
    ctx = dist_autograd._new_context()
    try:
        assert current_context() is ctx
        assert dist_autograd.current_context_id() == ctx._context_id()
        with pytest.raises(RuntimeError, match="Already have an autograd context id"):
            dist_autograd._new_context()
        x = torch.ones(2, requires_grad=True)
        for _ in range(3):
            dist_autograd.rpc_sync(worker_name(1), torch.add, args=(x, x))
        assert len(ctx._send_functions()) == 3 and len(ctx._recv_functions()) == 3
    finally:
        dist_autograd._release_context(ctx.context_id)
    # released here (no longer current) and on the worker it reached
    assert current_context() is None
    with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {ctx.context_id}"):
        dist_autograd._retrieve_context(ctx.context_id)
    with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {ctx.context_id}"):
        dist_autograd._release_context(ctx.context_id)
    wait_nothing_left(world_size)


@pytest.mark.slow
def test_new_release_context_and_max_id_in_rpc_world(rpc_world):
    rpc_world.run(_check_new_release_and_max_id)


def test_accumulate_all_adds_into_what_the_context_holds_even_the_same_tensor():
    """A first gradient is kept as is; a later one is added, also when it is the very tensor
    already held (a backward function may return one cached tensor in two runs)."""
    from refimpl.distributed_autograd.context import DistAutogradContext

    ctx = DistAutogradContext(3)
    a, b = torch.rand(2, requires_grad=True), torch.rand(2, requires_grad=True)
    g = torch.ones(2)
    ctx.accumulate_all({a: g})
    assert ctx.grads[a] is g
    ctx.accumulate_all({a: g, b: 2 * g})
    assert torch.equal(ctx.grads[a], torch.full((2,), 2.0)) and torch.equal(g, torch.ones(2))
    assert torch.equal(ctx.grads[b], torch.full((2,), 2.0))


# ---------------------------------------------------------------------------------------------
_kept: dict = {}  # per worker: what a check keeps between its RPCs


def _rref_of_ones():
    from torch.distributed import rpc

    _kept["t"] = torch.ones(3, requires_grad=True)
    return rpc.RRef(_kept["t"])


def _count_release_rpcs() -> None:
    from refimpl.distributed_autograd import lifetime

    real = lifetime.messaging.send_rpc

    def counted(dst, fn, args, on_done):
        if fn is lifetime._release:
            _kept["release_rpcs"] = _kept.get("release_rpcs", 0) + 1
        return real(dst, fn, args, on_done)

    lifetime.messaging.send_rpc = counted
    _kept["restore"] = real


def _release_rpcs_and_restore() -> int:
    from refimpl.distributed_autograd import lifetime

    lifetime.messaging.send_rpc = _kept.pop("restore")
    return _kept.pop("release_rpcs", 0)


def _check_release_follows_forward_rpcs(world_size):
    """A context that sent a worker a forward RPC releases it by RPC (behind any RPC nobody
    waited for); one that reached it only on the channel releases it there, and it is gone."""
    import refimpl.distributed_autograd as dist_autograd
    from refimpl.distributed_autograd.context import container

    owner = worker_name(1)
    rref = dist_autograd.rpc_sync(owner, _rref_of_ones)
    with dist_autograd.context():  # the first fetch is an RPC carrying the RRef
        dist_autograd.to_here(rref)
    wait_nothing_left(world_size)
    channel = container().channel
    deadline = time.monotonic() + 10
    while channel._outgoing(1) is None:  # the connection opens in the background
        assert time.monotonic() < deadline, "no channel connection to worker 1"
        with dist_autograd.context():
            dist_autograd.to_here(rref)
    _count_release_rpcs()
    try:
        sent = channel.calls_sent
        with dist_autograd.context():
            dist_autograd.to_here(rref)  # by key, on the channel
        assert channel.calls_sent == sent + 2, "fetch and release: two channel calls"
        wait_nothing_left(world_size)
        x = torch.ones(2, requires_grad=True)
        with dist_autograd.context():
            dist_autograd.rpc_sync(owner, torch.mul, args=(x, 2))
        wait_nothing_left(world_size)
    finally:
        assert _release_rpcs_and_restore() == 1, "the release after a forward RPC is an RPC"


@pytest.mark.slow
def test_release_goes_where_the_context_sent(rpc_world):
    rpc_world.run(_check_release_follows_forward_rpcs)


def test_runs_add_their_gradients_in_in_the_order_they_ran():
    """engine.py [Note: send first]: a run that adds in later marks the context while the runs
    are still ordered; the next run's mark waits until the one before has added in, so
    gradients are summed in run order whatever the threads do after sending."""
    import threading

    from refimpl.distributed_autograd.context import DistAutogradContext

    ctx = DistAutogradContext(3)
    ctx.begin_accumulation()  # the first run, still sending
    second = threading.Thread(target=ctx.begin_accumulation, daemon=True)
    second.start()
    second.join(0.2)
    assert second.is_alive() and ctx.accumulating == 1, "the second run did not wait its turn"
    ctx.end_accumulation()
    second.join(5)
    assert not second.is_alive() and ctx.accumulating == 1
    ctx.end_accumulation("boom")
    assert ctx.accumulating == 0 and ctx.accumulate_error == "boom"
