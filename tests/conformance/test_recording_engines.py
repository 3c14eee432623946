"""The upgrade gate on real engines: two DDPs that differ only in the order they sum the ranks'
gradients (tests/conformance/order_engines.py) both pass the oracle at 3 ranks, and
`gradparity compare` names the first step and tensor where they part; the same engine recorded
twice compares bitwise. A real w3 gloo world through the case pipeline, as `gradparity run` runs it."""

import pytest
import torch

from conformance.adapters.registry import ddp_class_spec
from conformance.case import Case
from conformance.frontends.compare_runs import compare, exit_status
from conformance.pipeline import run_case
from conformance.recording import Recorder, open_recording
from tests.conformance.area_cases import scenario

ASCENDING = ddp_class_spec("tests.conformance.order_engines:AscendingSum")
DESCENDING = ddp_class_spec("tests.conformance.order_engines:DescendingSum")
SCENARIO = "ddp/plain/mlp/w3/fp32"
pytestmark = pytest.mark.slow  # a w3 gloo world


def _record(directory, specs, session):
    rec = Recorder(str(directory))
    rec.start({"torch": torch.__version__})
    verdicts = {spec: run_case(Case(scenario(SCENARIO), spec), session, rec).verdict for spec in specs}
    rec.finish({"torch": torch.__version__})
    return verdicts, open_recording(str(directory))


def test_compare_names_the_first_step_and_tensor_two_summation_orders_part(tmp_path, session):
    verdicts, both = _record(tmp_path / "both", [ASCENDING, DESCENDING], session)
    assert verdicts == {ASCENDING: "passed", DESCENDING: "passed"}  # the oracle accepts either order
    doc = compare(both, both, adapters=[ASCENDING, DESCENDING])
    first = doc["first"]
    assert exit_status(doc, "bitwise") == 1 and first is not None
    assert first["point"] == "step 0 backward" and first["kind"] == "grad" and first["rank"] == 0
    # Independently of compare: every tensor recorded before the one it names is bitwise equal,
    # and that one differs (read straight from the two cases' stored values).
    a, d = (both.cases[f"{spec}|{SCENARIO}"] for spec in (ASCENDING, DESCENDING))
    named = (first["point"], first["kind"], first["name"], first["rank"])
    for ea, ed in zip(a["entries"], d["entries"], strict=True):
        key = (f"step {ea['step']} {ea['point']}" if ea["point"] != "init" else "construction", ea["kind"], ea["name"],
               ea["rank"])
        va, vd = a["tensors"].get(ea["digest"]), d["tensors"].get(ed["digest"])
        if key == named:
            assert not torch.equal(va, vd)
            break
        assert (va is None and vd is None) or torch.equal(va, vd), key
    else:
        raise AssertionError(f"compare named {named}, which is not recorded")
    # A reordered fp32 sum of 3 terms is within the oracle's rule for this scenario, never beyond it.
    assert doc["cases"][0]["status"] == "within" and exit_status(doc, "oracle") == 0


def test_the_same_engine_recorded_twice_is_bitwise(tmp_path, session):
    _, first = _record(tmp_path / "one", [DESCENDING], session)
    _, again = _record(tmp_path / "two", [DESCENDING], session)
    doc = compare(first, again)
    assert doc["first"] is None and doc["summary"] == doc["summary"] | {"bitwise": 1, "within": 0, "beyond": 0}
    assert exit_status(doc, "bitwise") == 0
