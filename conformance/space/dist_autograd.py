"""The `dist_autograd` area's scenario space: its dimensions, their values, the constraints between them.

Plain data, as the other areas' (`conformance.space.data_parallel`): `conformance.space.
dist_autograd_rows` turns a row into a `Scenario`, `conformance.space.profiles` generates the
profiles. The first value of each dimension is its default (what a hand-written scenario that does
not mention it has). Every dimension is one the generated composition
(`conformance.models.dist_autograd_composed`) builds and the runner (`conformance.runners.
dist_autograd`) drives: the topology, the workers, where parameters live, plain or nested
containers both ways, how each call is made, what goes unused, one root or several, retained
passes, the dtype, a failing remote backward and a second context. The oracle replays the same
composition in one process with plain autograd, so every combination is judged by that one rule
(the gradient contributions' order is the only freedom, a band scaled for a handful of summands
in the row's dtype, the area's rule since issue 7: no pair widens it). Values the suite cannot run
yet are not listed; `LEFT_OUT` says which and why.

Constraints, named with their reason, are of one kind here, *meaning*: a topology needs as many
workers as it names, and a pass that raises has no retained pass or second context after it. No
pair is excluded for want of a rule.
"""

from __future__ import annotations

from conformance.space.covering import Constraint, Dimension

DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("topology", ("simple", "chain", "fan-out", "round-trip", "sent-twice"),
              "0 -> 1 / 0 -> 1 -> ... -> W-1 / 0 -> each worker / 0 -> 1 -> 0 / one tensor to worker 1 twice and "
              "to each other worker once"),
    Dimension("world", (2, 3), "RPC workers"),
    Dimension("params", ("caller", "remote"), "leaves on worker 0 only / also a parameter each callee owns"),
    Dimension("structure", ("plain", "nested"), "tensors as arguments and results / inside tuples, lists and dicts"),
    Dimension("call", ("sync", "async", "rref"),
              "rpc_sync / rpc_async (a fan-out's calls all in flight before the first wait) / remote() and the "
              "user's RRef.to_here()"),
    Dimension("unused", ("none", "leaf", "arg"), "a leaf requiring grad used nowhere / sent and ignored by the callee "
              "(full: a remote result no root uses)"),
    Dimension("roots", ("one", "several"), "one root / one per call and the local part"),
    Dimension("passes", (1, 3), "backward passes in the context, all but the last with retain_graph=True"),
    Dimension("dtype", ("fp64", "fp32"), "the leaves' and parameters' dtype"),
    Dimension("error", ("none", "remote"), "the last worker reached raises in its backward"),
    Dimension("contexts", ("one", "two"), "the composition again in a second context after the first exits"),
)

# full adds 4 workers (a chain of three hops, a fan-out to three) and a remote result no root uses: torch's
# engine waits for a gradient of every send function, so such a backward hangs until the RPC timeout
# (60 s a case; xfailed, ends-world): the hand-written `unused-result` is in full for that reason too.
FULL_VALUES = {"world": (2, 3, 4), "unused": ("none", "leaf", "arg", "result")}

LEFT_OUT = {
    "sparse leaves and results": "the composition's products and tanh make dense gradients: a sparse path is a "
                                 "composition of its own (pinned: sparse, sparse-twice)",
    "TorchScript targets": "a script function takes no Python containers or mode string: pinned (torchscript, "
                           "torchscript-async)",
    "AccumulateGrad hooks, one buffer for two leaves, tensor-free callees": "properties of one composition each, "
                                                                             "pinned by name (issue 16, issue 30)",
    "contexts opened on two workers at once": "the runner's second caller is contexts-meet's own protocol (A18), "
                                              "pinned",
    "GPU tensors, the distributed optimizer, concurrent passes in one context": "not in the contract "
                                                                                 "(docs/contracts/dist_autograd.md)",
}


def _c(name: str, reason: str, reads: tuple[str, ...], allows) -> Constraint:
    return Constraint(name, reason, reads, allows)


CONSTRAINTS: tuple[Constraint, ...] = (
    _c("chain-needs-three", "a chain 0 -> 1 -> 2 needs three workers (at two it is simple)", ("topology", "world"),
       lambda a: a["topology"] != "chain" or a["world"] >= 3),
    _c("fan-out-needs-three", "a fan-out to two callees needs three workers (at two it is simple)",
       ("topology", "world"), lambda a: a["topology"] != "fan-out" or a["world"] >= 3),
    _c("error-first-pass", "the first pass raises: no retained pass follows it", ("error", "passes"),
       lambda a: a["error"] == "none" or a["passes"] == 1),
    _c("error-next-context", "after a failed pass the runner always checks a next context (A8); a second "
       "failing one is not that check", ("error", "contexts"),
       lambda a: a["error"] == "none" or a["contexts"] == "one"),
)
