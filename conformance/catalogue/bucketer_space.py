"""The plan of a generated bucketer scenario (issue 38): its calls built from a row's values.

A row of the bucketer space (`conformance.space.bucketer`) names what its plan holds at once:
the dtypes and process groups its calls cycle through, which calls pass a callback, the chunks'
layout, and whether a 0-dim call, zero-element calls or one input larger than a shard are among
them. `plan_space` builds that plan from the scenario's kwargs alone (as every plan kind of
`conformance.catalogue.bucketer`), so ranks and coordinator agree on it; the call form, input
reuse, idle flushes, rounds and teardown are the runner's scenario-wide switches.

Where the special calls go is chosen so each meets the state its bug would need:
- the 0-dim call second, in the first call's bucket (queued behind it where the cap allows);
- the zero-element calls right after the third call, in its bucket, while that call is queued
  where the cap allows (with bucketing disabled nothing is queued: FairScale then asserts in
  `flush()`, its recorded xfail, `conformance/adapters/xfails/fairscale-bucketer.txt`);
- the big call fifth, after small inputs of its dtype are queued: it must overtake them (B4).
"""

from __future__ import annotations

from conformance.catalogue.bucketer_calls import Call, shard_elements
from conformance.space.bucketer import GROUPS

LAYOUTS = ("contiguous", "transposed", "strided")
COUNT = 8  # ordinary calls per round


def plan_space(scenario, dtypes, size) -> list[Call]:
    """The calls of one round of a generated row (plan kind ``space``)."""
    kw = scenario.kwargs()
    groups = GROUPS[kw["group"]]
    layouts = LAYOUTS if kw["layout"] == "mixed" else (kw["layout"],)
    callbacks = kw["callbacks"]

    def has_callback(i: int) -> bool:  # the special calls below always pass one: their results are judged
        return callbacks == "all" or i % 3 != 2

    calls = []
    for i in range(COUNT):
        layout = layouts[i % len(layouts)]
        dtype = dtypes[i % len(dtypes)]
        # An ordinary call fits a shard of WORLD's bucket (the smallest; 8 fp64 elements at w8 with
        # the small cap): only the big call may be larger (the row's `big` says whether one is).
        shard = shard_elements(scenario.options.bucket_cap_mb, dtype, scenario.world_size) or 12
        if layout == "contiguous":
            n = size(1, 12)
            shape = ((min(n, shard),), (min(n, shard // 2, 6), 2), (2, min(n, shard // 2, 6), 1))[i % 3]
        else:  # a 2-D shape: transposed and strided chunks are non-contiguous
            shape = (min(size(1, 6), shard // 2), 2)
        calls.append(Call(shape, dtype, has_callback(i), group=groups[i % len(groups)],
                          layout=layout))
    if kw.get("big") == "yes":
        first = calls[0]
        calls.insert(4, Call(_big_shape(scenario, first.dtype, first.layout), first.dtype, True,
                             group=first.group, layout=first.layout))
    if kw.get("empty") == "yes":
        third = calls[2]
        calls[3:3] = [Call((0,), third.dtype, True, group=third.group, layout=third.layout),
                      Call((2, 0), third.dtype, True, group=third.group, layout=third.layout)]
    if kw.get("zero_dim") == "yes":
        first = calls[0]
        calls.insert(1, Call((), first.dtype, True, group=first.group, layout=first.layout))
    return calls


def _big_shape(scenario, dtype: str, layout: str) -> tuple[int, ...]:
    """Larger than one rank's shard of a bucket in every group (a group of one has the largest)."""
    n = shard_elements(scenario.options.bucket_cap_mb, dtype, 1) + 5
    return (n,) if layout == "contiguous" else ((n + 1) // 2, 2)
