"""Sharded `clip_grad_norm_` scenarios (issue 25 item 5, issue 26's clip family): clause S22.

Every sharded engine clips by the *global* norm, summed over the ranks' shards (refimpl: one
all-reduce of the shards' squared sums; FSDP1: its own `clip_grad_norm_`; FSDP2: torch's
`clip_grad_norm_` over DTensor gradients, whose partial norms are all-reduced). That is another
rounding order than the oracle's norm over the full tensors, so the clipped step is judged
against the bound derived for any order (`conformance.oracle.clip_bound`), not bitwise and not with a
band; an engine that clips each shard by its own local norm (pytorch/pytorch#170862's bug) is
off by a factor near √W in the coefficient and fails. The straight-through check (the oracle
trained from the seeds) keeps a band: a reordered coefficient compounds over the steps there.

Data are the DDP clip scenarios' (5 steps of SGD with momentum at lr 2^-10, clipping active at
every step: the gradient norms are 5-20 against max_norm 4 and 1); the units variant takes a
norm per unit first (more detours in the sum, inside the bound).
"""

from __future__ import annotations

from dataclasses import replace

from conformance.spec import Scenario, WrapOptions, float_tolerance

STEPS = 5


def scenarios() -> list[Scenario]:
    from conformance.catalogue.ddp_scenario import make
    from conformance.catalogue.profiles import QUICK, STANDARD
    from conformance.catalogue.sharded_clauses import clauses_of
    from conformance.spec import Capability as C

    def m(name, model, *, w, clip, profiles=STANDARD, options=WrapOptions(), **kw):  # noqa: B008
        need = frozenset({C.SHARD_UNITS}) if options.units else frozenset()
        s = make(name, model, area="sharded", w=w, steps=STEPS, profiles=profiles, options=options,
                 features=(("clip", clip),), extra_requires=need, **kw)
        band = float_tolerance(s.dtype, max(w, 2), "a reordered global norm's clip coefficient, compounding over steps")
        tol = s.tolerance
        if tol.kind in ("summation-order", "derived-bound"):
            tol = replace(tol, divide=("pre", "post", "split"))
        s = s.with_(tolerance=replace(tol, straight_through=band, reason=f"{tol.reason}; the clipped step's "
                                      "parameters: the bound derived for a reordered global norm (conformance.oracle.clip_bound)"))
        return s.with_(clauses=(*clauses_of(s), "S22"))

    return [
        m("clip-grad-norm", "mlp", w=2, clip=4.0, profiles=QUICK,
          description="clip_grad_norm_(4.0) by the global norm over shards, then SGD; a local-norm clip fails"),
        m("clip-grad-norm", "mlp", w=4, clip=1.0, description="global-norm clip at four ranks"),
        m("clip-grad-norm-units", "mlp", w=2, clip=4.0, options=WrapOptions(units="children"),
          description="global-norm clip with a unit per block (norms per unit, then across)"),
        m("clip-grad-norm", "transformer", w=3, clip=1.0,
          description="global-norm clip on continuous data at three ranks (gradients a summation order)"),
    ]
