"""HSDP's reduce-scatter-only accumulation (issue #26, clause S21).

On a (replicate, shard) mesh FSDP2 offers two ways to accumulate micro-batches:
``set_requires_gradient_sync(False)`` keeps each rank's full local gradient until the synced
backward (the ``hsdp-*-no-sync`` scenarios, S13), and ``set_requires_all_reduce(False)``
reduce-scatters every micro-batch inside the shard group, keeps the reduced chunk, and
all-reduces the accumulated chunk across the replicas only on the last micro-batch — less
memory (1/S of a gradient per rank) for one reduce-scatter per micro-batch. Its gradient is the
same mean, summed along another tree: per micro-batch inside each shard group first, then over
micro-batches, then over replicas. The oracle models that tree
(`conformance.oracle.envelope.staged_reduce`, [Note: the HSDP accumulation tree]): at w4 on a 2x2 mesh
every tree over two shares is one value, so each placement of 1/W gives one candidate and the
engine must equal one of them bitwise; local accumulation's 15 trees over four rank totals
would neither contain it nor reject its bugs as sharply. w8 (2x4) takes the tree's derived
bound (15^4 trees per placement are too many to enumerate).

Inside the accumulation there is no local gradient per rank to read (the suite skips those
reads, as for DeepSpeed's per-micro-batch reduction); the synced backward's gathered gradient
and every rank's parameters after the step are judged. The w2 (2, 1) mesh has shard groups of
one rank: the reduce-scatter is a copy and only the all-reduce across the two replicas
averages, so an engine that never all-reduces (or drops the accumulated chunk) shows at once
on exact data.
"""

from __future__ import annotations

from dataclasses import replace

from conformance.catalogue.profiles import FULL, QUICK, STANDARD
from conformance.spec import Capability as C
from conformance.spec import Scenario, WrapOptions

DIVIDE = ("pre", "post", "split")  # where sharded engines may place 1/W (conformance.oracle.envelope)


def scenarios() -> list[Scenario]:
    from conformance.catalogue.ddp_scenario import make
    from conformance.catalogue.sharded_clauses import clauses_of

    def m(name, model, replicas, *, w, micro, units=None, **kw):
        options = WrapOptions(hsdp_replicas=replicas, accumulate_reduce_scattered=True, units=units)
        need = {C.HSDP, C.HSDP_RS_ACCUMULATION} | ({C.SHARD_UNITS} if units else set())
        s = make(name, model, w=w, area="sharded", micro_batches=micro, options=options,
                 extra_requires=frozenset(need), **kw)
        if s.tolerance.kind in ("summation-order", "derived-bound"):
            s = s.with_(tolerance=replace(s.tolerance, divide=DIVIDE))
        extra = {"S13", "S21"}
        return s.with_(clauses=tuple(sorted(set(clauses_of(s)) | extra, key=lambda x: int(x[1:]))))

    return [
        m("hsdp-2x1-rs-accumulate", "mlp", 2, w=2, micro=2, profiles=QUICK,
          description="HSDP (2, 1) mesh, set_requires_all_reduce(False) on the first micro-batch: the "
                      "replicas' accumulated chunks all-reduced only on the last"),
        m("hsdp-2x2-rs-accumulate", "mlp", 2, w=4, micro=2, profiles=STANDARD,
          description="HSDP 2x2: each micro-batch reduce-scattered in its shard group, accumulated there, "
                      "all-reduced across the replicas on the last (FSDP2's tree)"),
        m("hsdp-2x2-rs-accumulate-nested", "mlp", 2, w=4, micro=3, units="children", steps=3, profiles=STANDARD,
          description="three micro-batches through per-block units (each unit accumulates its own chunk)"),
        m("hsdp-2x4-rs-accumulate", "mlp", 2, w=8, micro=2, model_kwargs={"width": 4}, profiles=FULL),
    ]
