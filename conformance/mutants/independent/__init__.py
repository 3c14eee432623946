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

Interaction zoos (issue 38, `interactions_<area>.py`): bugs that need two things at once (two
features, an option's non-default state, a value regime, the order of a user's calls), written
from the contracts and user docs without reading the catalogue. They are a set of their own,
not in `--set all` (they measure the catalogue's reach, they are not yet all caught)::

    gradparity zoo --area ddp --set interactions --profile standard
"""

# Each area's modules here are named by its entry (`conformance/areas/<area>.py`: `independent`,
# `interactions`).
