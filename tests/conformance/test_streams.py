"""conformance/oracle/streams.py (+ models/rng.py, the runners' records): dropout is replayed per
rank, so a correct engine passes with dropout on; an engine that moves the stream is named for it."""

from __future__ import annotations

import torch

from conformance import mutants
from conformance.adapters.registry import ddp_class_spec
from conformance.models import rng
from conformance.oracle.streams import Streams
from conformance.pipeline import Case, run_case
from tests.conformance.area_cases import scenario

DROPOUT = "ddp/dropout/gpt/w2/fp32"


class _Anchor:
    def __init__(self, states):
        self.states = states

    def rng_before(self, rank, step, micro):
        return self.states.get((rank, step, micro))


def test_a_recorded_stream_elsewhere_is_a_break_only_where_forward_draws():
    s = scenario(DROPOUT)
    moved = rng.start(s.seed, 0)
    with torch.random.fork_rng(devices=[]):
        rng.restore(moved)
        torch.rand(1)
        moved = rng.capture()
    streams = Streams(s, _Anchor({(0, 0, 0): moved, (1, 0, 0): moved}))
    with streams.forward(1, 0, 0):
        pass  # draws nothing: where the stream stood cannot matter
    assert streams.broken is None
    with streams.forward(0, 0, 0):
        torch.rand(3)  # draws: the masks came from a moved stream
    assert streams.broken[:3] == (0, 0, 0) and "drew random numbers between forwards" in streams.broken[3]


def test_the_replay_continues_each_ranks_own_stream():
    s = scenario(DROPOUT)
    streams, draws = Streams(s), []
    for step in range(2):
        with streams.forward(1, step, 0):
            draws.append(torch.rand(2))
    torch.manual_seed(rng.seed_of(s.seed, 1))
    assert torch.equal(torch.cat(draws), torch.rand(4)) and streams.broken is None


def test_a_correct_engine_passes_with_dropout_on(session):
    result = run_case(Case(scenario(DROPOUT), "torch-ddp"), session)
    assert result.verdict == "passed", result.message


def test_an_engine_that_draws_between_forwards_is_named_for_it(session):
    path, _ = mutants.MUTANTS["draws-between-forwards"]
    result = run_case(Case(scenario(DROPOUT), ddp_class_spec(path)), session)
    assert result.verdict == "failed" and result.fired, result.message
    assert "random-number stream before the forward of step 0, micro-batch 0" in result.message.splitlines()[0]
