"""The `bucketer` scenario catalogue: bucketed reduce-scatter (issue 6).

A scenario is a *plan*: a sequence of `reduce_scatter_async` calls (shape, dtype, with or
without a callback), repeated for `steps` rounds, each round ended by `flush()` (and
`teardown()` where the implementation has it). `plan()` builds it from the scenario alone,
so rank processes and the coordinator agree on it without sending tensors around.

The contract (what `conformance.runners.bucketer` checks, in this order):

1. Values — every callback receives a tensor of its input's shape and dtype holding, on rank
   r, the exact sum over ranks of chunk r of that input (integer data in [-8, 8]: sums of up
   to 4 ranks are exact in every dtype, fp16 included, in any order: bitwise).
2. Exactly once — every callback is called exactly once by the end of the round's
   `flush()`; never before its own `reduce_scatter_async` was entered; never again later.
3. Results stay valid — the tensor a callback received still holds its value after every
   later flush of the round (both implementations hand out views of a fresh output per
   flush; consumers such as sharded data parallel keep them as `.grad`).
4. Order, only where both FairScale 0.4.13 and refimpl document it:
   a. an input larger than one rank's shard of a bucket (`numel > cap / itemsize / W`),
      and every input when the cap is <= 0, is reduced at once: its callback runs before
      its `reduce_scatter_async` returns ("large inputs will be reduced immediately");
   b. callbacks of the *deferred* inputs of one dtype run in submission order (a bucket is
      a FIFO). Nothing is required across dtypes (refimpl documents "by first use of the
      bucket", FairScale does not say), nor between a deferred input and a later immediate
      one — that they legitimately differ from submission order is the documented surprise.
5. Inputs may be reused — overwriting the inputs right after `reduce_scatter_async`
   returns must not change any result (the "reuse" scenarios).

6. Process groups — a call's group may be any group, not only WORLD: its input list has
   one chunk per member, its result is the sum over the members, and calls on different
   groups interleave freely (one bucket per group).
7. Call forms and layouts — keyword calls (`input_list=`, `group=`, `callback_fn=`), 0-dim
   and non-contiguous chunks give the same results as positional, contiguous ones.
8. Lifecycle — a flush with nothing queued is a no-op; after flush (and teardown) the same
   bucketer serves the next round.

Caps: `None` is the implementation's default (25 MiB in both); a tiny cap flushes every few
inputs; 0 disables bucketing; an "oversized" cap makes one input larger than a shard.
The clause ids (`B1`...) are those of `docs/contracts/bucketer.md`.
"""

from __future__ import annotations

import torch

# The plan's vocabulary (re-exported: runners, oracle and tests import it from here).
from conformance.catalogue.bucketer_calls import DEFAULT_CAP_MB, Call, MiB, shard_elements  # noqa: F401
from conformance.catalogue.bucketer_space import plan_space
from conformance.catalogue.profiles import FULL, QUICK, STANDARD
from conformance.catalogue.profiles import SHORT_DTYPE as SHORT
from conformance.spec import Capability as C
from conformance.spec import Scenario, Tolerance, WrapOptions

EXACT_INTS = Tolerance(True, reason="exact: integers in [-8, 8], sums over <= 4 ranks are exact in every dtype")


def group_members(kind: str, rank: int, world_size: int) -> list[int]:
    """The global ranks of `rank`'s group of `kind` (every rank is in exactly one of each kind)."""
    if kind == "world":
        return list(range(world_size))
    if kind == "pairs":
        first = rank - rank % 2
        return list(range(first, min(first + 2, world_size)))
    if kind == "self":
        return [rank]
    raise ValueError(f"unknown bucketer group kind {kind!r}")


def must_be_immediate(scenario: Scenario, call: Call, rank: int = 0) -> bool:
    """Order rule 4a: reduced (callback run) before its own call returns."""
    size = len(group_members(call.group, rank, scenario.world_size))
    return call.numel > shard_elements(scenario.options.bucket_cap_mb, call.dtype, size)


def plan(scenario: Scenario) -> list[Call]:
    """The calls of one round, from the scenario's `model` (plan kind) and kwargs."""
    kw = scenario.kwargs()
    kind = scenario.model
    dtypes = kw.get("dtypes", (scenario.dtype,))
    g = torch.Generator().manual_seed(1000 + scenario.seed)

    def size(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    shapes = ((lambda n: (n,)), (lambda n: (n, 2)), (lambda n: (2, n, 1)))
    calls: list[Call] = []
    if kind in ("mixed", "reuse"):
        for i in range(kw.get("count", 12)):
            shape = shapes[i % 3](size(1, kw.get("max_numel", 40)))
            calls.append(Call(shape, dtypes[i % len(dtypes)], callback=(i % 7 != 6)))
    elif kind == "many-small":
        for i in range(kw.get("count", 200)):
            calls.append(Call((size(1, 8),), dtypes[i % len(dtypes)]))
    elif kind == "oversized":
        # Small inputs around one that exceeds a shard: the documented out-of-order case.
        big = kw["big_numel"]
        for i in range(kw.get("count", 9)):
            if i in kw.get("big_at", (3,)):
                calls.append(Call((big,), dtypes[0]))
            else:
                calls.append(Call((size(1, 16), 2), dtypes[i % len(dtypes)]))
    elif kind == "zero-size":
        calls = [Call((5,), dtypes[0]), Call((0,), dtypes[0]), Call((3, 0), dtypes[0]), Call((4,), dtypes[0])]
    elif kind == "only-empty":
        calls = [Call((0,), dtypes[0]), Call((2, 0), dtypes[0])]
    elif kind == "groups":
        # WORLD and a smaller group interleaved, one dtype: one bucket per group, sums over members.
        other = kw["group"]
        for i in range(kw.get("count", 10)):
            calls.append(Call((size(1, 12),), dtypes[i % len(dtypes)], group="world" if i % 2 else other))
    elif kind == "layouts":
        # 0-dim, transposed and strided chunks (same values as contiguous ones), one too big to bucket.
        layouts = ("contiguous", "transposed", "strided")
        calls = [Call((), dtypes[0])]
        for i in range(kw.get("count", 9)):
            calls.append(Call((size(1, 6), size(2, 5)), dtypes[i % len(dtypes)], layout=layouts[i % 3]))
        calls.append(Call((kw.get("big_numel", 800), 2), dtypes[0], layout="transposed"))
    elif kind in ISSUE30_PLANS:
        calls = ISSUE30_PLANS[kind](scenario, dtypes, size)
    elif kind == "space":  # a generated row's plan (issue 38)
        calls = plan_space(scenario, dtypes, size)
    else:
        raise ValueError(f"scenario {scenario.id}: unknown bucketer plan {kind!r}")
    return calls


def must_be_deferred(scenario: Scenario, call: Call, rank: int = 0) -> bool:
    """Fits a bucket (and has elements): queued, so its callback follows the bucket's FIFO order
    (rule 4b) - even one of exactly a shard's size, which the implementation may not reduce early."""
    return call.numel > 0 and not must_be_immediate(scenario, call, rank)


# -- issue 30: plans that fill the dimension checklist (docs/contracts/bucketer.md) --------------
def _plan_idle_bucket(scenario, dtypes, size):
    """Round 0 uses two buckets (dtypes[1] first), later rounds only dtypes[0]: at their flush a bucket
    created earlier is idle (how often: zero inputs in one bucket, work in the next)."""
    calls = [Call((size(1, 6),), dtypes[1], only_round=0)]
    for i in range(4):
        calls.append(Call((size(1, 6),), dtypes[0]))
        if i % 2:
            calls.append(Call((size(1, 6), 2), dtypes[1], only_round=0))
    return calls


def _plan_exact_fit(scenario, dtypes, size):
    """Small inputs, then one of exactly one shard's size (deferred: it must not overtake them),
    then more small ones (inputs: odd sizes at the boundary)."""
    shard = shard_elements(scenario.options.bucket_cap_mb, dtypes[0], scenario.world_size)
    return [Call((3,), dtypes[0]), Call((size(1, 5), 2), dtypes[0]), Call((shard,), dtypes[0]),
            Call((4,), dtypes[0]), Call((shard - 1,), dtypes[0]), Call((2,), dtypes[0])]


ISSUE30_PLANS = {"idle-bucket": _plan_idle_bucket, "exact-fit": _plan_exact_fit}


def end_of_life_calls(scenario: Scenario) -> list[Call]:
    """The inputs queued after the last flush when `teardown_queued` is set: `teardown()` must run
    their callbacks or refuse loudly (raise), never drop one (issue 30, end of life). By default one
    input; `teardown_shape` (a scenario keyword) gives its chunks' shape: `(0,)` queues an empty one.
    `teardown_calls`, ((shape, dtype, group), ...), queues several: two of one bucket (the order a
    teardown runs them in, B5), a subgroup's (B7), several dtypes' (B12)."""
    kw = scenario.kwargs()
    if "teardown_calls" in kw:
        return [Call(tuple(shape), dtype, group=group) for shape, dtype, group in kw["teardown_calls"]]
    return [Call(tuple(kw.get("teardown_shape", (3,))), scenario.dtype)]


def chunk(scenario: Scenario, *, round_: int, rank: int, index: int, dest: int, call: Call,
          device: str = "cpu") -> torch.Tensor:
    """Rank `rank`'s chunk `dest` of call `index` in round `round_`: integers in [-8, 8]."""
    g = torch.Generator().manual_seed(hash((scenario.seed, round_, rank, index, dest)) & 0x7FFF_FFFF)
    values = torch.randint(-8, 9, call.shape, generator=g)
    return values.to(dtype=getattr(torch, call.dtype), device=device)


def with_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as `t` in the call's memory layout (non-contiguous for the non-default ones)."""
    if layout == "transposed" and t.dim() == 2:
        return t.t().contiguous().t()
    if layout == "strided" and t.numel():
        wide = torch.zeros((*t.shape, 2), dtype=t.dtype, device=t.device)
        wide[..., 0] = t
        return wide[..., 0]
    return t


def make(name: str, kind: str, *, w: int = 2, cap: float | None = None, dtypes: tuple[str, ...] = ("float32",),
         profiles: frozenset = QUICK, steps: int = 1, clauses: tuple[str, ...] = (), **kwargs) -> Scenario:
    description = kwargs.pop("description", "")
    needs = {C.BUCKET_CAP} if cap is not None else set()
    if any(d in ("float16", "bfloat16") for d in dtypes):
        needs.add(C.HALF_PRECISION)
    derived = {LIFECYCLE} if steps > 1 else set()
    if len(dtypes) > 1:
        derived.add(DTYPES)
    cap_tag = "default" if cap is None else ("off" if cap <= 0 else f"{cap:g}mb")
    return Scenario(
        id=f"bucketer/{name}/{cap_tag}/w{w}/{'-'.join(SHORT[d] for d in dtypes)}",
        area="bucketer",
        model=kind,
        model_kwargs=tuple(sorted({**kwargs, "dtypes": dtypes}.items())),
        dtype=dtypes[0],
        world_size=w,
        steps=steps,
        optimizer="none",
        options=WrapOptions(bucket_cap_mb=cap),
        requires=frozenset(needs),
        tolerance=EXACT_INTS,
        buffer_rule="none",
        profiles=profiles,
        timeout_s=30.0,
        description=description,
        clauses=tuple(sorted(set(CORE) | set(clauses) | derived, key=lambda c: int(c[1:]))),
    )


MIXED = ("float32", "float64", "int64", "float16")
TINY = 0.0005  # 524 bytes per bucket: a flush every few inputs
# Clauses every scenario checks (docs/contracts/bucketer.md): values, exactly once, results stay
# valid, deferred FIFO order; the others name what a scenario adds.
CORE = ("B1", "B2", "B3", "B5")
IMMEDIATE, REUSE, GROUPS, FORMS, LAYOUTS, EMPTY, LIFECYCLE, DTYPES = "B4", "B6", "B7", "B8", "B9", "B10", "B11", "B12"


def handwritten() -> list[Scenario]:
    """The hand-written scenarios: the contract's clauses one by one, upstream cases by name."""
    out = [
        make("mixed", "mixed", w=2, cap=TINY, dtypes=MIXED, steps=2,
             description="mixed sizes, shapes and dtypes; tiny cap: many flushes to make room; two rounds"),
        make("oversized", "oversized", w=2, cap=0.01, big_numel=2000, clauses=(IMMEDIATE,),
             description="one input larger than a shard (1310 fp32 elements at w2): its callback runs "
                         "before the call returns, ahead of earlier small inputs (documented by both)"),
        make("groups", "groups", w=2, cap=TINY, group="self", steps=2, clauses=(GROUPS,),
             description="WORLD and a group of one interleaved: one bucket per group, sums over its members"),
        make("forms", "layouts", w=2, cap=0.005, keyword=True, idle_flush=True, clauses=(FORMS, LAYOUTS, LIFECYCLE),
             description="keyword calls; 0-dim, transposed and strided chunks; flush with nothing queued"),
        make("mixed", "mixed", w=1, cap=TINY, dtypes=MIXED, profiles=STANDARD, description="world size 1"),
        make("mixed", "mixed", w=3, cap=TINY, dtypes=MIXED, profiles=STANDARD),
        make("mixed", "mixed", w=4, cap=TINY, dtypes=MIXED, steps=2, profiles=STANDARD),
        make("mixed", "mixed", w=2, dtypes=MIXED, profiles=STANDARD, description="default cap: one flush"),
        make("disabled", "mixed", w=2, cap=0, dtypes=MIXED, profiles=STANDARD, clauses=(IMMEDIATE,),
             description="cap 0 disables bucketing: every callback before its call returns"),
        make("disabled", "mixed", w=3, cap=0, profiles=STANDARD, clauses=(IMMEDIATE,)),
        make("many-small", "many-small", w=2, dtypes=("float32", "float16"), count=200, profiles=STANDARD,
             description="200 tiny inputs, default cap"),
        make("many-small", "many-small", w=4, cap=0.001, count=200, profiles=STANDARD),
        make("oversized", "oversized", w=4, cap=0.01, dtypes=("float32", "float64"), big_numel=1000,
             big_at=(0, 4, 8), profiles=STANDARD, clauses=(IMMEDIATE,)),
        make("oversized", "oversized", w=3, cap=0.01, dtypes=("float64",), big_numel=500, steps=2,
             profiles=STANDARD, clauses=(IMMEDIATE,)),
        make("reuse", "reuse", w=2, cap=TINY, dtypes=MIXED, reuse=True, clauses=(REUSE,),
             description="inputs overwritten right after each call returns: results unchanged"),
        make("zero-size", "zero-size", w=2, cap=TINY, clauses=(EMPTY,),
             description="inputs with no elements: their callbacks too run exactly once, with an empty result"),
        make("only-empty", "only-empty", w=2, cap=TINY, profiles=STANDARD, clauses=(EMPTY,),
             description="a round whose only inputs have no elements: callbacks still run exactly once"),
        # Issue 30, ambient state: every rank's default dtype switched to float64 around the calls
        # (restored after, the pool's ranks live on); results keep their inputs' float32.
        make("default-dtype-fp64", "zero-size", w=2, cap=TINY, default_dtype="float64", steps=2, profiles=STANDARD,
             clauses=(EMPTY, DTYPES),
             description="float32 inputs, empty ones among them, under a float64 default dtype: results stay float32"),
        make("groups", "groups", w=4, cap=TINY, group="pairs", dtypes=("float32", "int64"), steps=2,
             profiles=STANDARD, clauses=(GROUPS,),
             description="WORLD and pairs of ranks interleaved (two groups of two at w4)"),
        make("groups", "groups", w=3, cap=0, group="pairs", profiles=STANDARD, clauses=(GROUPS, IMMEDIATE),
             description="bucketing off; pairs at w3 (ranks 0-1 and rank 2 alone)"),
        make("keyword", "mixed", w=2, cap=TINY, dtypes=MIXED, keyword=True, profiles=STANDARD, clauses=(FORMS,),
             description="every call by keyword: input_list=, group=, callback_fn="),
        make("layouts", "layouts", w=3, cap=0.005, dtypes=("float64", "int64"), steps=2, profiles=STANDARD,
             clauses=(LAYOUTS,), description="0-dim, transposed and strided chunks at w3, two rounds"),
        make("idle-flush", "mixed", w=2, cap=TINY, idle_flush=True, steps=3, profiles=STANDARD, clauses=(LIFECYCLE,),
             description="flush before any call and twice at the end; three rounds on one bucketer"),
        make("bf16", "mixed", w=2, cap=TINY, dtypes=("bfloat16", "int32"), profiles=FULL),
    ]
    out += idle_fit_and_teardown_scenarios()
    for w in (1, 2, 3, 4):
        for cap in (None, TINY, 0):
            out.append(make("sweep", "mixed", w=w, cap=cap, dtypes=MIXED, count=24, steps=3, profiles=FULL))
    return out


def idle_fit_and_teardown_scenarios() -> list[Scenario]:
    """An idle bucket, an exact fit, groups by keyword, teardown with inputs queued (issue 30: the
    cells of the dimension checklist the scenarios above leave empty; who: a group
    given by keyword; how often: an idle bucket at flush; inputs: an input of exactly one shard; end
    of life: teardown() with an input still queued). Quick keeps one at w2 for each."""
    return [
        make("idle-bucket", "idle-bucket", w=2, cap=TINY, dtypes=("float32", "float64"), steps=2,
             teardown_queued=True, clauses=(LIFECYCLE,),
             description="round 2 leaves the float64 bucket idle; after the last flush one more input is queued "
                         "and teardown() must run its callback or raise"),
        make("idle-bucket", "idle-bucket", w=3, cap=TINY, dtypes=("int64", "float16"), steps=3,
             teardown_queued=True, profiles=STANDARD, clauses=(LIFECYCLE,)),
        make("exact-fit", "exact-fit", w=2, cap=TINY, clauses=(IMMEDIATE,),
             description="an input of exactly one shard after smaller ones: deferred, in FIFO order"),
        make("exact-fit", "exact-fit", w=3, cap=0.001, dtypes=("float64",), steps=2, profiles=STANDARD,
             clauses=(IMMEDIATE,)),
        make("keyword-groups", "groups", w=2, cap=TINY, group="self", keyword=True, clauses=(GROUPS, FORMS),
             description="group= by keyword with a group of one: the keyword must not fall back to WORLD"),
        make("keyword-groups", "groups", w=4, cap=TINY, group="pairs", keyword=True, dtypes=("float32", "int64"),
             steps=2, profiles=STANDARD, clauses=(GROUPS, FORMS)),
        make("only-empty", "only-empty", w=2, clauses=(EMPTY,),
             description="only zero-element inputs, default cap (quick): callbacks still run exactly once"),
        make("teardown-empty", "idle-bucket", w=2, cap=TINY, dtypes=("float32", "float64"), steps=2,
             teardown_queued=True, teardown_shape=(0,), profiles=STANDARD, clauses=(LIFECYCLE, EMPTY),
             description="an empty input is the one left at teardown(): its callback runs once, or teardown raises"),
        # round 9: end of life x order, groups and dtypes (several inputs left at teardown())
        make("teardown-fifo", "idle-bucket", w=2, cap=TINY, dtypes=("float32", "float64"), steps=2,
             teardown_queued=True, teardown_calls=(((3,), "float32", "world"), ((2, 2), "float32", "world")),
             profiles=STANDARD, clauses=(LIFECYCLE,),
             description="two inputs of one bucket left at teardown(): both callbacks, in submission order, or a raise"),
        make("teardown-group", "idle-bucket", w=4, cap=TINY, dtypes=("float32", "float64"), steps=2,
             teardown_queued=True, teardown_calls=(((3,), "float32", "pairs"), ((3,), "float32", "world")),
             profiles=STANDARD, clauses=(LIFECYCLE, GROUPS),
             description="a subgroup's bucket and WORLD's both hold an input at teardown(): neither dropped"),
        make("teardown-dtypes", "idle-bucket", w=2, cap=TINY, dtypes=("float32", "float64"), steps=2,
             teardown_queued=True,
             teardown_calls=(((3,), "float32", "world"), ((3,), "float64", "world"), ((4,), "int64", "world")),
             profiles=STANDARD, clauses=(LIFECYCLE, DTYPES),
             description="three dtypes' buckets each hold an input at teardown(): none dropped"),
    ]
