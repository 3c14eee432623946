"""Sharded-area families of issue #26 (part B): dimensions FSDP2's own tests cover that change
where state lives or how it travels, never a value, so the oracle is the plain data-parallel one.

* S15 two forwards before one backward (``loss = f(x) + f(x')``, the ``two_forwards`` loop
  switch of `conformance.models.data`): a unit resharded after the first forward is gathered
  again for the second, and again for backward; each parameter's gradient sums both uses.
* S16 a state-dict round trip after 2 of 5 steps: ``sharded`` (each rank's DTensors through
  ``torch.distributed.checkpoint``) or ``full``; a rebuilt engine (another seed) loads model
  and optimizer state and trains on, bitwise what straight-through training gives
  (`conformance.runners.sharded_checkpoint`). SGD with momentum and Adam: a load that loses
  optimizer state changes the first step after it.
* S17 FSDP2's ``CPUOffloadPolicy``: shards, gradients and the optimizer step on CPU, gathered
  to the compute device per unit. On a CPU-only machine both devices are the CPU, so this
  checks the code path (pin_memory off), not the copies; with ``--device cuda`` it is real.
* S18 FSDP2's ``shard_placement_fn`` (rule ``dim1-if-even``, `conformance.judge.shards.placement_dim`):
  dim 1 where W divides it, dim 0 (uneven: 17 rows, 3 rows) elsewhere; S12 checks each shard
  against the placement asked for, not only against the one the engine reports.

Each needs a capability (skipped with it named elsewhere) except two forwards, which every
engine runs: refimpl ZeRO-2/ZeRO-3, FSDP1 and FSDP2.
"""

from __future__ import annotations

from dataclasses import replace

from conformance.catalogue.profiles import FULL, QUICK, STANDARD
from conformance.spec import Capability as C
from conformance.spec import Scenario, WrapOptions

NESTED = WrapOptions(units="children", reshard_after_forward=True)


def _features(**kw) -> tuple:
    return tuple(sorted(kw.items()))


def scenarios() -> list[Scenario]:
    from conformance.catalogue.ddp_scenario import make
    from conformance.catalogue.sharded_clauses import clauses_of

    def m(name, model, clause, *, need=(), **kw):
        options = kw.get("options", WrapOptions())
        need = set(need) | ({C.SHARD_UNITS} if options.units else set())
        s = make(name, model, area="sharded", extra_requires=frozenset(need), **kw)
        if s.tolerance.kind in ("summation-order", "derived-bound"):
            s = s.with_(tolerance=replace(s.tolerance, divide=("pre", "post", "split")))
        return s.with_(clauses=tuple(sorted(set(clauses_of(s)) | {clause}, key=lambda x: int(x[1:]))))

    two = {"two_forwards": True}
    placed = WrapOptions(shard_placement="dim1-if-even")
    uneven = {"width": 17, "d_out": 3}  # 17x8 on dim 1 (8 = 2W at w4), 17x17 and 3x17 on dim 0, uneven
    offload = WrapOptions(cpu_offload=True)

    def ckpt(kind, model="mlp", w=2, optimizer="sgd", options=WrapOptions(), profiles=STANDARD):  # noqa: B008
        name = f"state-dict-{kind}" + ("-nested" if options.units else "") + ("-adam" if optimizer == "adam" else "")
        # Five steps, as every feature family has (tests/conformance/test_features.py): 2 before the
        # save, 3 after the load.
        return m(name, model, "S16", w=w, steps=5, optimizer=optimizer, options=options,
                 features=_features(save_load_at=2, state_dict=kind), need=(C.STATE_DICT,), profiles=profiles,
                 description=f"train 2 steps, save a {kind} state dict (model + optimizer), rebuild the engine "
                             "from another seed, load, train 3 more: equal to 5 steps straight through")

    return [
        # S15: two forwards before one backward
        m("two-forwards", "mlp", "S15", w=2, model_kwargs=two, profiles=STANDARD,
          description="loss = f(x) + f(x'): two forward calls, one backward"),
        m("nested-two-forwards", "mlp", "S15", w=2, model_kwargs=two, options=NESTED, profiles=STANDARD,
          description="two forwards through units resharded after each: gathered again for the second "
                      "forward and for backward"),
        m("nested-two-forwards", "mlp", "S15", w=4, model_kwargs=two, options=NESTED, profiles=STANDARD),
        m("nested-two-forwards", "transformer", "S15", w=2, model_kwargs=two, options=NESTED, optimizer="adam",
          profiles=FULL),
        # One step: an engine adds a rank's 4 contributions (2 micro-batches x 2 forwards) in an order of
        # its own (FSDP2 per forward's post-backward), and after the first step the parameters are no
        # longer small integers, so sums of 4 round: 1 ulp apart, not a bug. Step 0 is exact in any order.
        m("two-forwards-no-sync", "mlp", "S15", w=2, steps=1, micro_batches=2, model_kwargs=two, options=NESTED,
          profiles=STANDARD, description="two forwards per micro-batch, the first micro-batch without sync"),
        # S16: state-dict round trips
        ckpt("sharded", profiles=QUICK),
        ckpt("full"),
        ckpt("sharded", optimizer="adam", options=NESTED),
        ckpt("sharded", w=4, optimizer="adam"),
        ckpt("full", model="transformer", optimizer="adam", options=NESTED, profiles=FULL),
        # S17: CPUOffloadPolicy
        m("cpu-offload", "mlp", "S17", w=2, options=offload, need=(C.CPU_OFFLOAD,), profiles=QUICK,
          description="FSDP2 CPUOffloadPolicy: shards and the optimizer step on CPU"),
        m("cpu-offload-nested", "mlp", "S17", w=2, micro_batches=2, optimizer="adam",
          options=replace(NESTED, cpu_offload=True), need=(C.CPU_OFFLOAD,), profiles=STANDARD),
        # S18: a custom shard_placement_fn with uneven sizes
        m("shard-placement", "mlp", "S18", w=2, model_kwargs=uneven, options=placed, need=(C.SHARD_PLACEMENT,),
          profiles=QUICK, description="shard_placement_fn: dim 1 where W divides it, else dim 0 (17 and 3 rows)"),
        m("shard-placement", "mlp", "S18", w=4, model_kwargs=uneven, options=replace(NESTED, shard_placement="dim1-if-even"),
          need=(C.SHARD_PLACEMENT,), profiles=STANDARD),
        m("shard-placement-no-sync", "mlp", "S18", w=2, micro_batches=2, model_kwargs=uneven, options=placed,
          need=(C.SHARD_PLACEMENT,), profiles=FULL),
    ]
