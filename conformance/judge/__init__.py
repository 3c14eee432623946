"""The judge: the ranks' records against the oracle, and what a failure is.

- `contract`  the data-parallel contract checks (DESIGN.md, "The contract"): every rank's
              parameters, gradients and buffers at every comparison point against the oracle;
              a `Checked` on success;
- `shards`    the sharded engines' local shards against the slices of the oracle's full tensors;
- `compare`   tensors within a `Tolerance` (bitwise, an envelope, a derived bound, a band) and a
              mismatch message a user can act on without rerunning;
- `failure`   the failure taxonomy: wrong value, raised, crashed, hung, infrastructure; each
              non-pass with its class and a one-line cause.

(Not to be confused with `conformance.frontends.compare_runs`, the command that compares two
recorded runs.)
"""

from conformance.judge.compare import (
           ConformanceError,
           Mismatch,
           compare_dicts,
           compare_tensor,
           failure_message,
)
from conformance.judge.contract import Checked, check_records, repro_command
from conformance.judge.failure import Classified, FailureClass, classify_exception

__all__ = ["Checked", "Classified", "ConformanceError", "FailureClass", "Mismatch", "check_records",
           "classify_exception", "compare_dicts", "compare_tensor", "failure_message", "repro_command"]
