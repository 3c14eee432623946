"""Module paths of conformance that moved, kept importing for one minor version with a warning.

Until 0.2.0 the suite's oracle, judge and front ends were flat modules of `conformance`
(`conformance.baseline`, `conformance.contract`, `conformance.cli`, ...); they moved into one
package per role (`conformance.oracle`, `conformance.judge`, `conformance.frontends`; #41).
Code written against the old paths keeps working through 0.2.x: each old path is a module of two
lines that calls `reexport`, which warns (a `DeprecationWarning` naming the new path) and copies
the new module's names, as refimpl's moved paths do (`refimpl._deprecated`). They are removed in
`REMOVED_IN`. CHANGELOG.md lists them; tests/conformance/test_deprecated_paths.py imports each
one and checks the warning.
"""

from __future__ import annotations

from refimpl._deprecated import MovedModules

REMOVED_IN = "0.3.0"

# old module path -> where its names live now
MOVED = {
    "conformance.accumulation": "conformance.oracle.accumulation",
    "conformance.allreduce_order": "conformance.oracle.allreduce_order",
    "conformance.anchor": "conformance.oracle.anchor",
    "conformance.baseline": "conformance.oracle.baseline",
    "conformance.baseline_events": "conformance.oracle.baseline_events",
    "conformance.baseline_features": "conformance.oracle.baseline_features",
    "conformance.baseline_mixed": "conformance.oracle.baseline_mixed",
    "conformance.clip_bound": "conformance.oracle.clip_bound",
    "conformance.envelope": "conformance.oracle.envelope",
    "conformance.replica_oracle": "conformance.oracle.replica_oracle",
    "conformance.deepspeed_clip": "conformance.oracle.declared.deepspeed_clip",
    "conformance.loss_scaler": "conformance.oracle.declared.loss_scaler",
    "conformance.powersgd_oracle": "conformance.oracle.declared.powersgd_oracle",
    "conformance.compare": "conformance.judge.compare",
    "conformance.contract": "conformance.judge.contract",
    "conformance.failure": "conformance.judge.failure",
    "conformance.shards": "conformance.judge.shards",
    "conformance.cli": "conformance.frontends.cli",
    "conformance.compare_runs": "conformance.frontends.compare_runs",
    "conformance.options": "conformance.frontends.options",
    "conformance.plugin": "conformance.frontends.plugin",
    "conformance.zoo": "conformance.frontends.zoo",
    "conformance.harness.torchrun": "conformance.frontends.torchrun",
    "conformance.feature_support": "conformance.adapters.feature_support",
    "conformance.models.zoo": "conformance.models.builtin",
    "conformance.mutants.zoo": "conformance.mutants.ddp",
    "conformance.mutants.loop_zoo": "conformance.mutants.training_loop",
    "conformance.mutants.features_zoo": "conformance.mutants.ddp_features",
}
# names that were renamed as they moved: old path -> {old name: new name}
RENAMED = {"conformance.models.zoo": {"ZOO": "BUILTIN_MODELS"}}


_PATHS = MovedModules("gradparity", REMOVED_IN, MOVED, RENAMED)
message = _PATHS.message
reexport = _PATHS.reexport
