"""DDP scenarios for the cells of the dimension checklist the rest of the catalogue left empty
(issue 30, the table at the end of docs/contracts/ddp.md).

Each one checks a clause from a side the others do not: when the `no_sync()` flag is read (a
forward inside it, its backward outside), how often (synced backwards without `zero_grad`, with
and without bucket views; a parameter frozen at the first forward, used later), who (a parameter
only a non-zero rank uses; under `join()`, rank 0 running out of data first), which inputs (a
forward's outputs in a dict and a list), which ambient dtype (float64 on continuous data, where a
float32 round trip shows) and end of life (a `no_sync()` accumulation thrown away by `zero_grad`).
They were written after measuring the catalogue against the independent zoo
(`conformance.mutants.independent.ddp`); each of its bugs shows at 2 ranks, so those are in quick.
Standard adds the same cells at 3 ranks, and autocast (ambient) combined with `no_sync()`,
unused parameters, buffers and `join()`.
"""

from __future__ import annotations

from collections.abc import Callable

from conformance.catalogue.ddp_scenario import FUF
from conformance.catalogue.profiles import STANDARD
from conformance.spec import Capability as C
from conformance.spec import Scenario, WrapOptions

VIEW = WrapOptions(gradient_as_bucket_view=True)


def _f(**features) -> tuple:
    return tuple(sorted(features.items()))


def scenarios(m: Callable[..., Scenario]) -> list[Scenario]:
    """`m` is the DDP catalogue's scenario maker (ids, tolerances, capabilities)."""
    out = [
        m("no-sync-split", "mlp", micro_batches=3, model_kwargs={"no_sync_split": True}, clauses=("D3",),
          description="forwards inside no_sync() with their backward outside it, and the synced forward's backward "
                      "inside it: the forward decides"),
        m("accumulate-no-zero-grad", "mlp", steps=3, optimizer="none", clauses=("D2", "D11"),
          description="three synced backwards, no optimizer and no zero_grad: each adds its average to the last"),
        m("accumulate-no-zero-grad-view", "mlp", steps=3, optimizer="none", options=VIEW, clauses=("D7", "D11"),
          description="the same with gradient_as_bucket_view: the .grad tensors are the bucket buffers"),
        m("discard-no-sync", "mlp", steps=2, micro_batches=2, model_kwargs={"discard_no_sync": True},
          clauses=("D3", "D11"), description="a no_sync() backward thrown away by zero_grad() before each step's "
                                             "micro-batches: none of it reaches the step"),
        m("used-on-odd-ranks", "branches", options=FUF, model_kwargs={"mode": "used-on-odd-ranks"}, clauses=("D4",),
          description="a parameter rank 0 does not use but rank 1 does: averaged, not decided by rank 0"),
        m("dict-output", "dict-out", options=FUF, clauses=("D2", "D4"),
          description="the forward returns a dict holding a tensor and a list: find_unused_parameters walks it all"),
        m("fp64-continuous", "mlp", dtype="float64", exact_data=False, clauses=("D9",),
          description="float64 parameters on continuous data: a reduction in another dtype shows"),
        m("join-rank0-first", "mlp", steps=5, features=_f(join=(2, 5)), extra_requires=frozenset({C.JOIN}),
          clauses=("D10",), upstream="pytorch/pytorch#38174",
          description="uneven inputs under join(), rank 0 runs out first: every rank ends with rank 1's model"),
        m("requires-grad-toggle-from-frozen", "mlp", steps=5, options=FUF, clauses=("D4",),
          features=_f(freeze=((0, "layers.0", False), (2, "layers.0", True))),
          description="first layer frozen from the first forward, unfrozen at step 2: the unused set changes"),
        # standard: the same cells at 3 ranks
        m("no-sync-split", "mlp", w=3, micro_batches=2, model_kwargs={"no_sync_split": True}, clauses=("D3",),
          profiles=STANDARD),
        m("join-rank0-first", "mlp", w=3, steps=5, features=_f(join=(1, 5, 3)), extra_requires=frozenset({C.JOIN}),
          clauses=("D10",), profiles=STANDARD, upstream="pytorch/pytorch#38174"),
        # standard: autocast (ambient) combined with no_sync, unused parameters, buffers and join
        m("autocast-no-sync", "mlp", micro_batches=2, steps=5, features=_f(autocast="bfloat16"), clauses=("D3", "D13"),
          profiles=STANDARD, description="no_sync() accumulation of autocast (bf16) forwards"),
        m("autocast-unused", "branches", steps=5, options=FUF, model_kwargs={"mode": "unused-on-rank1"},
          features=_f(autocast="bfloat16"), clauses=("D4", "D13"), profiles=STANDARD,
          description="find_unused_parameters' graph walk through autocast's cast nodes"),
        m("autocast-buffers", "buffered", steps=5, features=_f(autocast="bfloat16"), clauses=("D6", "D13"),
          profiles=STANDARD, description="rank 0's buffers broadcast before autocast forwards that use them"),
        m("join-autocast", "mlp", steps=5, features=_f(join=(2, 5), autocast="bfloat16"),
          extra_requires=frozenset({C.JOIN}), clauses=("D10", "D13"), profiles=STANDARD,
          description="join() with rank 0 out first, autocast forwards"),
    ]
    return out
