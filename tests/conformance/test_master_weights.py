"""The declared rule `precision: fp32-master` (DeepSpeed's bf16 optimizer) changes what is expected."""

from __future__ import annotations

import torch

from conformance import catalogue
from conformance.oracle.baseline import compute
from conformance.semantics import Precision, Semantics


def test_fp32_masters_step_differently_from_bf16_parameters_and_are_cast_back():
    s = next(x for x in catalogue.select(profile="full") if x.id == "ddp/bf16-params/mlp/w2/bf16")
    master = [e for e in compute(s, Semantics(precision=Precision.FP32_MASTER)).events if e.kind == "step"]
    plain = [e for e in compute(s).events if e.kind == "step"]
    assert all(t.dtype == torch.bfloat16 for t in master[-1].per_rank[0].values())
    differ = sum(int((master[-1].per_rank[0][n] != plain[-1].per_rank[0][n]).sum()) for n in master[-1].per_rank[0])
    assert differ > 0  # momentum kept in fp32 moves the second step: the rule is observable
