"""Known-bad implementations written from the contract documents alone (issue 30).

Why a second zoo: each area zoo in `conformance.mutants` was written beside the scenario that
catches it, so its 100% says little about what a *new* bug would meet. The mutants here were
written from `docs/contracts/<area>.md` and `DESIGN.md` only, before their authors read the
catalogue or the existing zoos; each is a realistic slip along one dimension of the clause
checklist (who decides, when a flag is read, how often something runs, which inputs, which
ambient state, end of life), recorded as `dimension` next to its clause.

Each area module keeps a `conformance.mutants.registry.Registry` (`MUTANTS`) and a `correct`
factory (the same code path without the bug), so a mutant loads like any adapter::

    gradparity run --adapter conformance.mutants.independent.bucketer:late_binding_callbacks -k bucketer

and `gradparity zoo --area <area>` counts them beside the area's own mutants.
"""

AREA_MODULES = {
    "data_parallel": "conformance.mutants.independent.data_parallel",
    "bucketer": "conformance.mutants.independent.bucketer",
    "sharded": "conformance.mutants.independent.sharded",
    "ddp": "conformance.mutants.independent.ddp",
    "dist_autograd": "conformance.mutants.independent.dist_autograd",
}
