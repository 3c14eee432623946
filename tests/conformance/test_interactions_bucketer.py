"""Each bucketer interaction mutant (issue 38) is genuinely buggy: in a 2-rank gloo world, outside
the suite, on an input where its two things meet, it fires and gives other results than the
correct bucketer; the correct one gives the sums worked out by hand and never fires."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conformance.mutants.independent import interactions_bucketer as zoo
from tests.refimpl._refimpl_world import run_world

pytestmark = pytest.mark.slow

W = 2


def _chunks(rank, n, dtype=torch.float32):
    """Chunk d on this rank: (rank + 1) * (d + 1) + arange(n) % 3 (integers: exact in every dtype)."""
    return [((rank + 1) * (d + 1) + torch.arange(n) % 3).to(dtype) for d in range(W)]


def _by_hand(rank, n):
    """The sum over the 2 ranks of their chunk `rank`: 3 * (rank + 1) + 2 * (arange(n) % 3)."""
    return 3.0 * (rank + 1) + 2.0 * (torch.arange(n) % 3)


def _probe(name, rank):
    """What one bucketer does where its mutant's two things meet (None: the correct one)."""
    adapter = getattr(zoo, name.replace("-", "_"))() if name else zoo.correct()
    world, seen = dist.group.WORLD, {}

    def record(key, log=None):
        def fn(out):
            seen.setdefault(key, []).append((str(out.dtype), out.float().tolist()))
            if log is not None:
                log.append(key)
        return fn

    b = adapter.make(0)  # bucketing disabled x a keyword call
    b.reduce_scatter_async(input_list=_chunks(rank, 3), group=world, callback_fn=record("disabled-keyword"))
    b.flush()
    log = []  # a negative cap: reduced before the call returns
    b2 = adapter.make(-1.0)
    b2.reduce_scatter_async(_chunks(rank, 3), world, record("negative", log))
    seen["negative-before-return"] = log == ["negative"]
    b2.flush()
    b3 = adapter.make(0)  # bf16 x the path that reduces at once
    b3.reduce_scatter_async(_chunks(rank, 3, torch.bfloat16), world, record("bf16"))
    b3.flush()
    b4 = adapter.make(1.0)  # a keyword call x inputs reused after it returns
    inputs = _chunks(rank, 3)
    b4.reduce_scatter_async(input_list=inputs, group=world, callback_fn=record("keyword-reuse"))
    for t in inputs:
        t.fill_(99)
    b4.flush()
    fired = [getattr(x, "mutation_fired", 0) for x in (b, b2, b3, b4)]
    return {"seen": seen, "fired": sum(fired)}


def _worker(rank, world_size, names):
    return {name: _probe(name, rank) for name in names}


@pytest.fixture(scope="module")
def results():
    return run_world(_worker, W, ["", *zoo.MUTANTS], timeout=120.0)


def test_the_correct_bucketer_gives_the_sums_by_hand_and_never_fires(results):
    for rank, r in enumerate(results):
        ok = r[""]
        want = _by_hand(rank, 3).tolist()
        for key, dtype in (("disabled-keyword", "torch.float32"), ("negative", "torch.float32"),
                           ("bf16", "torch.bfloat16"), ("keyword-reuse", "torch.float32")):
            assert ok["seen"][key] == [(dtype, want)], (rank, key)
        assert ok["seen"]["negative-before-return"] is True
        assert ok["fired"] == 0


@pytest.mark.parametrize(("name", "key"), [
    ("disabled-keyword-callback-lost", "disabled-keyword"),
    ("negative-cap-buckets", "negative-before-return"),
    ("bf16-immediate-upcasts", "bf16"),
    ("keyword-queues-caller-tensors", "keyword-reuse"),
])
def test_each_mutant_fires_and_differs_where_its_two_things_meet(results, name, key):
    for r in results:
        assert r[name]["fired"] > 0, name
        assert r[name]["seen"].get(key) != r[""]["seen"][key], (name, key)
