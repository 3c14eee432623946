"""The `dist_autograd` scenario catalogue (distributed autograd over RPC, issue 7).

`model` names a composition in `conformance.models.dist_autograd.COMPOSITIONS`; the
world size is the number of RPC workers (2 or 3). Data are float64 uniform in [-1, 1].

Tolerance: local autograd accumulates a tensor's gradient contributions (a tensor sent twice,
fan-out, several roots, a round trip) in its own order; a distributed engine sums them in the
order messages arrive, so results may differ by rounding: float64 with a band scaled for a
handful of summands. A lost or duplicated contribution is off by O(1), far outside it.
"""

from __future__ import annotations

from conformance.catalogue.profiles import FULL, QUICK, STANDARD
from conformance.spec import Scenario, float_tolerance

TOL = float_tolerance("float64", 8, "float64: gradient contributions accumulated in another order than local autograd")


def make(kind: str, w: int, profiles: frozenset = QUICK, description: str = "", **fields) -> Scenario:
    return Scenario(
        id=f"dist_autograd/{kind}/w{w}/fp64",
        area="dist_autograd",
        model=kind,
        dtype="float64",
        world_size=w,
        steps=1,
        optimizer="none",
        tolerance=TOL,
        exact_data=False,
        buffer_rule="none",
        profiles=profiles,
        timeout_s=fields.pop("timeout_s", 30.0),
        description=description,
        **fields,
    )


def handwritten() -> list[Scenario]:
    return with_clauses([
        make("simple", 2, description="one rpc_sync to worker1; the loss on worker0"),
        make("chain", 3, description="A -> B -> C, parameters on B and C"),
        make("fan-out", 3, description="one tensor to two workers"),
        make("sent-twice", 3, STANDARD, description="one tensor sent twice to worker1 and once to worker2"),
        make("round-trip", 2, description="A -> B -> A, a parameter on A used by the return trip"),
        make("multi-roots", 3, STANDARD, description="four roots in one backward"),
        make("unused-leaf", 2, STANDARD, description="a leaf requiring grad used nowhere: absent"),
        make("unused-arg", 2, timeout_s=15.0,
             description="a sent tensor the callee ignores: absent, and the pass completes"),
        make("unused-result", 2, FULL, timeout_s=15.0,
             description="a remote result the loss never uses (a send function with no gradient)"),
        make("structures", 2, description="tensors in nested tuples/lists/dicts, both ways"),
        make("remote-params", 3, STANDARD, description="parameters owned by worker1 and worker2"),
        make("async", 3, FULL, description="two rpc_async calls in flight at once"),
        make("retain-graph", 3, STANDARD, description="3 passes with retain_graph then one without: 4x"),
        make("remote-error", 3, description="worker2's backward raises: 'Error on Node 2' on the caller, "
             "no context left anywhere, and the next backward works"),
        make("simple", 3, FULL),
        make("round-trip", 3, FULL),
        make("fan-out", 3, FULL, seed=1).with_(id="dist_autograd/fan-out/w3/fp64/seed1"),
        make("contexts-meet", 3, description="worker0 and worker1 each open a context whose graph "
             "meets the other's on worker2 (w2): ids unique across workers, gradients kept apart"),
    ] + CLAUSE_SCENARIOS + torch_suite_finding_scenarios() + repeated_and_combined_use_scenarios())


# -- clauses of docs/contracts/dist_autograd.md (issue 15) -----------------------------------------
# Every scenario checks the context's gradients (A1), that no .grad is written (A3) and that no
# context or pass is left on any worker (A7); the others by what the composition exercises.
EVERY = ("A1", "A3", "A7")
KIND_CLAUSES = {
    "sent-twice": ("A2",), "fan-out": ("A2",), "unused-leaf": ("A4",), "unused-arg": ("A4",),
    "unused-result": ("A4",), "retain-graph": ("A5",), "multi-roots": ("A6",), "remote-error": ("A8",),
    "structures": ("A9",), "async": ("A10",), "chain": ("A11",), "remote-params": ("A11",), "round-trip": ("A11",),
    # issue 16's scenarios
    "rref-to-here": ("A12",), "sparse": ("A13",), "torchscript": ("A14",), "tensor-free": ("A15",),
    "shared-grad": ("A16",), "accumulate-hooks": ("A17",),
    # issue 30's
    "local-only": ("A3",), "rref-twice": ("A12",), "async-single": ("A10",), "retain-graph-simple": ("A5",),
    "roots-twice": ("A6",), "async-structures": ("A9", "A10"), "sparse-twice": ("A2", "A13"),
    "accumulate-hooks-retained": ("A5", "A17"), "tensor-free-single": ("A15",),
    "chain-structures": ("A9", "A11"), "rref-arg": ("A12",), "torchscript-async": ("A10", "A14"),
    "tensor-free-twice": ("A15",), "retain-graph-structures": ("A5", "A9"), "shared-grad-retained": ("A5", "A16"),
    # issue 40's
    "contexts-meet": ("A11", "A18"),
}
CLAUSE_SCENARIOS = [
    make("async", 3, STANDARD, seed=2, description="two rpc_async calls in flight at once (A10 in standard)")
    .with_(id="dist_autograd/async/w3/fp64/seed2"),
]


def with_clauses(scenarios: list[Scenario]) -> list[Scenario]:
    def key(c: str) -> int:
        return int(c[1:])
    return [s.with_(clauses=tuple(sorted({*EVERY, *KIND_CLAUSES.get(s.model, ())}, key=key))) for s in scenarios]


# -- issue 16: the failure classes torch's own dist_autograd tests found in refimpl -------------
def torch_suite_finding_scenarios() -> list[Scenario]:
    """The failure classes torch's own dist_autograd tests found in refimpl (issue 16)."""
    return [
        make("rref-to-here", 2, description="torch's own RRef.to_here() of a remote result carries "
             "the gradient back (never a silent detached copy)"),
        make("sparse", 2, description="a sparse leaf and a sparse result cross the RPC; sparse "
             "gradients stay sparse"),
        make("torchscript", 2, description="a TorchScript function as the RPC target"),
        make("tensor-free", 3, STANDARD, description="a worker reached only by an RPC without "
             "tensors requiring grad: its context is released too"),
        make("shared-grad", 2, STANDARD, description="one backward returns one tensor for two "
             "leaves: each leaf gets a gradient buffer of its own"),
        make("accumulate-hooks", 2, description="a post hook on a leaf's AccumulateGrad "
             "node runs once per pass"),
    ]


# -- issue 30: cells of the dimension checklist (the table in docs/contracts/dist_autograd.md) ---
# written after measuring the catalogue against the independent zoo
# (conformance.mutants.independent.dist_autograd): how often (zero RPCs in a context, a second
# fetch of one RRef, retained passes at two workers), when (an asynchronous reply at two workers).
# Each bug shows with two workers, so all are quick; so are `structures`, `unused-arg`,
# `torchscript`, `accumulate-hooks` and the two-worker `roots-twice` and `tensor-free-single`:
# quick catches every mutant of both zoos whose bug shows with two workers.
def repeated_and_combined_use_scenarios() -> list[Scenario]:
    """One thing used twice or combined: an RRef fetched twice, a root twice, passes retained,
    nested structures over RPC, a single async call, a context with no RPC (issue 30: checklist
    cells the scenarios above leave empty)."""
    return [
        make("local-only", 2, description="a context in which nothing crosses an RPC: gradients in the context, "
             "never in .grad"),
        make("rref-twice", 2, description="one remote() result fetched twice with RRef.to_here(): both fetches "
             "carry the gradient back"),
        make("async-single", 2, description="one rpc_async at two workers, its future waited on"),
        make("retain-graph-simple", 2, description="2 passes with retain_graph then one without, across one "
             "RPC: 3x"),
        # standard: the inputs and how-often cells of A6, A10, A13 and A17
        make("roots-twice", 2, description="the same root twice in one backward: twice its gradient (quick: A6 at "
             "two workers)"),
        make("tensor-free-single", 2, description="the only callee is reached by an RPC without tensors requiring "
             "grad: its context is released too (quick: A15 at two workers)"),
        make("async-structures", 2, STANDARD, description="nested arguments and results through rpc_async"),
        make("sparse-twice", 2, STANDARD, description="a sparse leaf sent in two calls: both contributions, "
             "still sparse"),
        make("accumulate-hooks-retained", 2, STANDARD, description="an AccumulateGrad hook over 3 passes (2 "
             "retained): it runs once per pass"),
        # round 9: the inputs cells of A5, A11, A12 and the how-often cells of A14, A15, A16
        make("retain-graph-structures", 2, STANDARD, description="3 passes (2 retained) over nested arguments "
             "and results: 3x"),
        make("chain-structures", 3, STANDARD, description="A -> B -> C with nested containers at both hops"),
        make("rref-arg", 3, STANDARD, description="an RRef passed to an RPC on a third worker, fetched there "
             "from its owner"),
        make("torchscript-async", 2, STANDARD, description="a TorchScript target through rpc_async and "
             "rpc_sync in one context"),
        make("tensor-free-twice", 2, STANDARD, description="two tensor-free calls to the only callee: its "
             "context released"),
        make("shared-grad-retained", 2, STANDARD, description="one tensor returned for two leaves, over 3 passes "
             "(2 retained): each leaf's buffer its own every pass"),
    ]
