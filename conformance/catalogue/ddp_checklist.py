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
unused parameters, buffers and `join()`; since round 9 also the wrapper built under `no_grad()`,
a comm hook under autocast and under `join()`, reentrant checkpointing under autocast, a bf16
model through a checkpoint round trip and two round trips in one run.
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
        # round 9: the cells round 8 left open (grad mode at construction, a hook and reentrant
        # checkpointing under autocast, end of life of a low-precision model and of a joined rank's
        # hook, two round trips in one run)
        m("wrap-under-no-grad", "mlp", steps=5, features=_f(wrap_under="no_grad"), clauses=("D1",),
          profiles=STANDARD, description="the wrapper constructed inside torch.no_grad(): the construction "
                                         "broadcast and the gradient hooks must not depend on grad mode"),
        m("checkpoint-round-trip-bf16", "mlp", dtype="bfloat16", steps=5, features=_f(save_load_at=2),
          clauses=("D9", "D15"), profiles=STANDARD,
          description="bf16 parameters through a save, rebuild and load: they come back in bf16, unrounded"),
        m("checkpoint-round-trip-twice", "mlp", steps=5, optimizer="adam", features=_f(save_load_at=(2, 4)),
          clauses=("D15",), profiles=STANDARD,
          description="two round trips in one run: a wrapper rebuilt from a checkpoint is saved again"),
        m("autocast-hook", "mlp", steps=5, options=WrapOptions(comm_hook="allreduce"),
          features=_f(autocast="bfloat16"), clauses=("D12", "D13"), profiles=STANDARD,
          description="a comm hook (its future's callback runs on another thread) under autocast forwards"),
        m("join-hook", "mlp", steps=5, options=WrapOptions(comm_hook="allreduce"), features=_f(join=(2, 5)),
          extra_requires=frozenset({C.JOIN}), clauses=("D10", "D12"), profiles=STANDARD,
          description="join() with a comm hook: the joined rank's shadow all-reduces run through the hook"),
        m("ckpt-reentrant-autocast", "ckpt-mlp", steps=5, options=WrapOptions(static_graph=True),
          features=_f(checkpoint="reentrant", autocast="bfloat16"), clauses=("D13", "D14"), profiles=STANDARD,
          description="reentrant checkpointing under autocast: the recompute's casts, finalized at the outer "
                      "backward"),
    ]
    return out
