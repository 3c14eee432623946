"""The bucketer area's scenario space: its dimensions, their values, and the constraints between them.

Plain data, as the DDP and sharded areas' (`conformance.space.ddp`, `.sharded`): a row is one
plan of `reduce_scatter_async` calls (`conformance.catalogue.bucketer_space` builds it) and
the rounds, call form and lifecycle around it; `conformance.space.bucketer_rows` turns a row into
a `Scenario`, `conformance.space.profiles` generates the profiles, and
`conformance.catalogue.scenarios` puts them after the pinned ones. The first value of each
dimension is its default (what most hand-written scenarios use: the tiny cap, one fp32 input per
call on WORLD, positional, one round). Every value is judged by the area's exact rules
(`conformance.runners.bucketer`: bitwise integer sums, exactly-once callbacks, the order both
references document); a value the suite cannot run is not listed (`LEFT_OUT` says why).

Constraints, named with their reason, are of the *meaning* kind only: the bucketer's oracle is
one rule (the exact sum over the group's members) that composes with every value here.
"""

from __future__ import annotations

from conformance.space.covering import Constraint, Dimension

# cap value -> bucket_cap_mb (None: the implementation's default, 25 MiB in both references).
CAPS = {"small": 0.0005, "default": None, "off": 0.0, "negative": -1.0}
# dtypes value -> the dtypes its calls cycle through ("mixed": the catalogue's MIXED).
DTYPES = {"fp32": ("float32",), "fp64": ("float64",), "fp16": ("float16",), "bf16": ("bfloat16",),
          "int64": ("int64",), "int32": ("int32",), "mixed": ("float32", "float64", "int64", "float16")}
# group value -> the group kinds its calls cycle through (`conformance.catalogue.bucketer.group_members`).
GROUPS = {"world": ("world",), "pairs": ("pairs",), "self": ("self",), "world-and-pairs": ("world", "pairs"),
          "world-and-self": ("world", "self")}

DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("world", (2, 1, 3, 4), "world size (8 in full)"),
    Dimension("cap", tuple(CAPS), "bucket_cap_mb: 0.0005 (a flush every few inputs), the default (25), "
              "0 and -1 (bucketing disabled: every input reduced at once)"),
    Dimension("dtypes", tuple(DTYPES), "one dtype for every call, or four cycled (one bucket each)"),
    Dimension("callbacks", ("all", "some"), "callback_fn on every call, or None on every third"),
    Dimension("group", tuple(GROUPS), "the calls' process groups: one kind, or WORLD interleaved with another"),
    Dimension("layout", ("contiguous", "transposed", "strided", "mixed"),
              "the chunks' memory layout (2-D shapes for the non-contiguous ones; mixed: the three cycled)"),
    Dimension("zero_dim", ("no", "yes"), "a 0-dim call among the others"),
    Dimension("empty", ("no", "yes"), "zero-element calls, (0,) and (2, 0), after a queued input of their bucket"),
    Dimension("big", ("no", "yes"), "a call larger than one rank's shard of a bucket, after small ones (B4)"),
    Dimension("form", ("positional", "keyword"), "reduce_scatter_async(inputs, group, fn) or by keyword"),
    Dimension("reuse", ("no", "yes"), "the inputs overwritten right after each call returns (B6)"),
    Dimension("idle_flush", ("no", "yes"), "flush() before the first call and twice at the end of each round"),
    Dimension("rounds", (1, 2, 3), "rounds on one bucketer, each ended by flush() (and teardown())"),
    Dimension("teardown", ("plain", "queued"), "teardown() after the last flush, or with an input still queued"),
)

# The tier `standard` covers pair by pair in rows of its own (`conformance.space.profiles`): a
# bucketer without HALF_PRECISION (a backend without fp16/bf16 collectives) skips every row with
# fp16, bf16 or the mixed dtypes, and still meets every pair of the other dimensions. A bucketer
# without BUCKET_CAP is not tiered: `make(bucket_cap_mb)` is the protocol's one constructor, and
# its pairs show as uncovered, the capability named (`gradparity list --coverage`).
TIERS = (("bucketers without half precision", {"dtypes": ("fp32", "fp64", "int64", "int32")}, ()),)

# full adds world size 8 (8 gloo ranks on 2 cores: seconds per case, standard stops at 4).
FULL_VALUES = {"world": (2, 1, 3, 4, 8)}

LEFT_OUT = {
    "callbacks=none (callback_fn=None on every call)": "a plan without a callback judges only that none ran and "
    "nothing raised: every pair such a row held would count as covered with no value checked (the rows with "
    "`some` pass None on every third call: B2's `None means no call` is checked there, beside values)",
    "a cap of exactly one shard's input (exact fit)": "needs the input sized from the cap per dtype and group: the "
    "pinned exact-fit scenarios keep it",
    "a bucket idle in a later round": "a plan whose calls differ by round: the pinned idle-bucket scenarios keep it",
    "a float64 default dtype around the calls": "ambient state, one pinned scenario (default-dtype-fp64)",
    "several inputs of several groups or dtypes left at teardown()": "the pinned teardown-fifo, -group, -dtypes",
    "GPU tensors": "CPU only here (no GPU in this project's CI); the same plans run with --device cuda",
}


def _c(name: str, reason: str, reads: tuple[str, ...], allows) -> Constraint:
    return Constraint(name, reason, reads, allows)


CONSTRAINTS: tuple[Constraint, ...] = (
    _c("big-needs-small-cap", "an input larger than a shard needs a small cap: the default cap's shard is 25 MiB/W "
       "(millions of elements), and a cap <= 0 reduces every input at once (no shard to exceed)",
       ("big", "cap"), lambda a: a["big"] == "no" or a["cap"] == "small"),
)
