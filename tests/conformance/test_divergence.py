"""conformance/judge/divergence.py and conformance/report/divergence_html.py: a failure names the
first (step, micro-batch, module, tensor) out of its rule, and the report draws every module ×
event against the rule, readable for a 100-tensor model."""

from __future__ import annotations

from conformance import mutants
from conformance.adapters.registry import ddp_class_spec
from conformance.pipeline import Case, run_case
from conformance.report.divergence_html import picture
from tests.conformance.area_cases import scenario


def test_a_failure_names_where_it_first_diverged_and_maps_every_event(session):
    path, _ = mutants.MUTANTS["expert-wrong-group"]
    result = run_case(Case(scenario("ddp/plain/moe/w2/fp32"), ddp_class_spec(path)), session)
    assert result.verdict == "failed"
    assert ("first outside its rule: after backward (step 0, micro-batch 0, synced), module moe.0.experts.0.w_in, "
            "tensor weight") in result.message
    dv = result.details["divergence"]
    assert dv["first"] == {"event": 0, "tensor": "moe.0.experts.0.w_in.weight"}
    assert dv["events"] == ["s0 m0", "s0 params", "s1 m0", "s1 params", "s2 m0", "s2 params"]
    router = dv["tensors"].index("moe.0.router.weight")
    experts = [i for i, n in enumerate(dv["tensors"]) if ".experts." in n]
    for row in dv["cells"][0::2]:  # every backward: experts out (where used), the router within its rule
        assert row[router] == 0.0 and max(row[i] for i in experts) > 1e5
    assert all(v == 0.0 for row in dv["cells"][1::2] for v in row)  # re-anchored: each step's parameters right
    assert "Where it diverged" in picture(dv)


def test_the_picture_groups_a_100_tensor_model_by_module_and_outlines_the_first_cell():
    tensors = [f"h.{layer}.{m}.{t}" for layer in range(25) for m in ("attn", "mlp") for t in ("weight", "bias")]
    events = [f"s{s} m0" for s in range(4)]
    cells = [[0.0] * 100 for _ in events]
    for s in (2, 3):  # layer 5's MLP from step 2
        cells[s][tensors.index("h.5.mlp.weight")] = 3e6
    cells[3][tensors.index("h.7.attn.bias")] = -1.0  # a structural mismatch
    page = picture({"events": events, "tensors": tensors, "cells": cells, "first": {"event": 2, "tensor": "h.5.mlp.weight"},
                    "unit": "ulps outside the rule", "rule": "bitwise"})
    assert page.count('<td class="m">') == 50  # 100 tensors, 50 modules
    assert page.count('class="first"') == 1 and "h.5.mlp at s2 m0: worst weight 3e+06 ulps outside" in page
    assert "h.7.attn at s3 m0: worst bias structural mismatch" in page
    assert "First out of its rule: <b>h.5.mlp.weight</b> at <b>s2 m0</b>" in page
