"""`gradparity compare` (conformance/frontends/compare_runs.py): ulps, the oracle's rule between two runs,
first divergence, exit statuses. Fast: recordings written from fake records, no process group."""

import json

import pytest
import torch

from conformance.case import Case
from conformance.frontends.compare_runs import (
    accepts,
    compare,
    exit_status,
    render_text,
    tensor_diff,
    ulp_distance,
)
from conformance.recording import Recorder, RecordingError, open_recording
from tests.conformance.test_recording import SCENARIO, ddp_record, result_of

ELEMENTWISE = {"kind": "band", "rtol": 1e-6, "atol": 0.0, "describe": "rtol=1e-06 atol=0"}
BITWISE = {"kind": "bitwise", "describe": "bitwise"}


def test_ulps_count_the_floats_in_between():
    one = torch.tensor([1.0])
    assert ulp_distance(one, torch.nextafter(one, torch.tensor([2.0]))).item() == 1
    assert ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0])).item() == 0
    tiny = torch.tensor([1e-45])  # the smallest fp32 subnormal: -tiny, -0, +0, +tiny are 2 apart end to end
    assert ulp_distance(tiny, -tiny).item() == 2
    assert ulp_distance(torch.tensor([float("nan")]), one).item() == float("inf")
    assert ulp_distance(torch.tensor([float("nan")]), torch.tensor([float("nan")])).item() == 0
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        a = torch.tensor([3.0], dtype=dtype)
        assert ulp_distance(a, torch.nextafter(a, torch.tensor([4.0], dtype=dtype))).item() == 1


def test_a_tensor_is_bitwise_within_or_beyond_the_oracles_rule():
    base = torch.tensor([1.0, 2.0, 0.0])
    moved = base.clone()
    moved[1] = torch.nextafter(moved[1], torch.tensor(3.0))
    d = tensor_diff(base, moved, ELEMENTWISE)
    assert (d["status"], d["differing"], d["max_ulps"]) == ("within", 1, 1.0)
    assert d["max_rel"] == pytest.approx(2 ** -23, rel=1e-3)  # one ulp of 2.0, relative to 2.0
    far = base + torch.tensor([0.0, 0.5, 0.0])
    assert tensor_diff(base, far, ELEMENTWISE)["status"] == "beyond"
    assert tensor_diff(base, moved, BITWISE)["status"] == "beyond"  # an exact scenario accepts no drift
    zero = torch.tensor([1.0, 2.0, -0.0])  # other bits, equal values: the oracle's bitwise rule accepts it
    assert tensor_diff(base, zero, BITWISE)["status"] == "within"
    specials = torch.tensor([float("nan"), float("inf"), 1.0])
    d = tensor_diff(specials, specials.clone(), ELEMENTWISE)  # other NaN bits are no difference to weigh
    assert (d["max_ulps"], d["max_rel"], d["max_abs"]) == (0.0, 0.0, 0.0)
    d = tensor_diff(specials, torch.tensor([1.0, float("inf"), 1.0]), ELEMENTWISE)
    assert (d["max_ulps"], d["max_rel"], d["status"]) == ("inf", "inf", "beyond")
    assert tensor_diff(None, base, ELEMENTWISE)["why"] == "None in BASE, a tensor in NEW"
    assert "in BASE" in tensor_diff(base, base.double(), ELEMENTWISE)["why"]
    norm = {"kind": "norm", "norm_rtol": 0.01, "atol": 0.0}
    assert accepts(norm, torch.ones(100), torch.ones(100) * 1.005)
    assert not accepts(norm, torch.ones(100), torch.ones(100) * 1.02)

def test_a_derived_rule_judges_by_its_case_and_step_never_by_the_straight_through_band():
    base = torch.tensor([1.0, 2.0, 0.0])
    moved = base.clone()
    moved[1] = torch.nextafter(moved[1], torch.tensor(3.0))
    far = base * (1 + 1e-3)  # inside the straight-through band below, outside every derived rule
    order = {"kind": "summation-order", "between_runs": {"kind": "band", "rtol": 0.5, "atol": 0.0, "describe": "rtol=0.5"},
             "describe": "bitwise to a summation order"}
    without = tensor_diff(base, moved, order)  # no rule recorded for the step: equality only, never the band
    assert without["status"] == "beyond" and "no rule derived for this step" in without["why"]
    envelope = {"candidates": torch.stack([base, moved])}  # the summation orders NEW's shares allow
    assert tensor_diff(base, moved, order, envelope)["status"] == "within"
    assert tensor_diff(base, far, order, envelope)["status"] == "beyond"
    bound = {"center": base.double(), "radius": torch.full((3,), 1e-6, dtype=torch.float64)}
    assert tensor_diff(base, moved, order, bound)["status"] == "within"
    d = tensor_diff(base, far, order, bound)
    assert d["status"] == "beyond" and "derived for this case and step" in d["why"]
    assert tensor_diff(base, moved, order, {"values": moved})["status"] == "within"
    assert tensor_diff(base, moved, order, {"values": base})["status"] == "beyond"
    from conformance.recording import digest

    assert tensor_diff(base, moved, order, {"digest": digest(moved)})["status"] == "within"  # NEW's own bitwise value
    assert tensor_diff(base, moved, order, {"digest": digest(base)})["status"] == "beyond"  # edited after the run


def record_dir(path, cases: dict) -> str:
    """A recording of {adapter: {rank: record}} for SCENARIO."""
    rec = Recorder(str(path))
    rec.start({"torch": "x", "adapter_versions": {}})
    for spec, records in cases.items():
        rec.add(*result_of(Case(SCENARIO, spec), records), where="w2/gloo/cpu")
    rec.finish({"torch": "x", "adapter_versions": {}})
    return str(path)


def two_ranks(**kwargs) -> dict:
    return {0: ddp_record(**kwargs), 1: ddp_record(**kwargs)}


def nudged(record: dict) -> dict:
    """The step's parameter `w` one ulp up at element 4: a summation order the oracle accepts."""
    w = record["events"][1]["values"]["w"]
    w.view(-1)[4] = torch.nextafter(w.view(-1)[4], torch.tensor(1e9))
    return record


def test_first_divergence_names_the_case_step_and_tensor(tmp_path):
    base = open_recording(record_dir(tmp_path / "a", {"torch-ddp": two_ranks()}))
    same = open_recording(record_dir(tmp_path / "b", {"torch-ddp": two_ranks()}))
    doc = compare(base, same)
    assert doc["first"] is None and doc["summary"]["bitwise"] == 1 and exit_status(doc, "bitwise") == 0
    new = open_recording(record_dir(tmp_path / "c", {"torch-ddp": {0: nudged(ddp_record()), 1: nudged(ddp_record())}}))
    doc = compare(base, new)
    first = doc["first"]
    assert (first["case"], first["point"], first["kind"], first["name"], first["rank"]) == (
        "torch-ddp|ddp/fake/mlp/w2/fp32", "step 0 step", "param", "w", 0)
    assert first["status"] == "within" and first["max_ulps"] == 1.0 and first["differing"] == 1
    case = doc["cases"][0]
    assert [p["differing"] for p in case["points"]] == [0, 0, 2]  # construction, backward, step (w on 2 ranks)
    assert exit_status(doc, "bitwise") == 1 and exit_status(doc, "oracle") == 0
    text = "\n".join(render_text(doc, "bitwise"))
    assert "first divergence: torch-ddp|ddp/fake/mlp/w2/fp32 at step 0 step: param w (rank 0)" in text
    assert "ran on w2/gloo/cpu" in text  # the backend and device each case ran on
    assert "0 bitwise, 1 within the oracle's rule, 0 beyond it" in text


def test_a_run_that_stopped_early_is_beyond_and_one_sided_cases_are_listed(tmp_path):
    base = open_recording(record_dir(tmp_path / "a", {"torch-ddp": two_ranks(), "refimpl-ddp": two_ranks()}))
    short = {r: ddp_record() for r in (0, 1)}
    for record in short.values():
        del record["events"][1:]  # no step recorded: as if the run died after the backward
    new = open_recording(record_dir(tmp_path / "b", {"torch-ddp": short}))
    doc = compare(base, new)
    assert doc["only_base"] == ["refimpl-ddp|ddp/fake/mlp/w2/fp32"] and doc["only_new"] == []
    assert doc["cases"][0]["status"] == "beyond" and doc["first"]["why"] == "recorded in BASE only"
    assert doc["cases"][0]["max_ulps"] == 0.0  # nothing to weigh: no ulps made up for a missing tensor
    assert exit_status(doc, "oracle") == 1
    assert "parts at step 0 step, param w (recorded in BASE only)" in "\n".join(render_text(doc, "oracle"))


def test_a_case_skipped_on_one_side_is_listed_not_weighed(tmp_path):
    from conformance.pipeline import CaseResult

    base = open_recording(record_dir(tmp_path / "a", {"torch-ddp": two_ranks(), "refimpl-ddp": two_ranks()}))
    rec = Recorder(str(tmp_path / "b"))
    rec.start({})
    rec.add(*result_of(Case(SCENARIO, "torch-ddp"), two_ranks()))
    rec.add(CaseResult(Case(SCENARIO, "refimpl-ddp"), "skipped", "lacks capability: no_sync"))
    rec.finish({})
    doc = compare(base, open_recording(str(tmp_path / "b")))
    assert doc["not_run"] == [{"case": "refimpl-ddp|ddp/fake/mlp/w2/fp32", "verdicts": ["passed", "skipped"]}]
    assert doc["summary"]["compared"] == 1 and exit_status(doc, "bitwise") == 0


def test_a_case_that_passed_and_now_fails_fails_the_gate_and_is_printed_first(tmp_path):
    from conformance.pipeline import CaseResult

    base = open_recording(record_dir(tmp_path / "a", {"torch-ddp": two_ranks()}))
    rec = Recorder(str(tmp_path / "b"))
    rec.start({})
    _, outcome = result_of(Case(SCENARIO, "torch-ddp"), two_ranks())  # the same tensors: bitwise
    rec.add(CaseResult(Case(SCENARIO, "torch-ddp"), "failed", "rank 1: gradients differ from the oracle"), outcome)
    rec.finish({})
    doc = compare(base, open_recording(str(tmp_path / "b")))
    assert doc["verdict_changes"] == [{"case": "torch-ddp|ddp/fake/mlp/w2/fp32", "verdicts": ["passed", "failed"],
                                       "fails_gate": True, "message": "rank 1: gradients differ from the oracle"}]
    assert doc["cases"][0]["counts"]["beyond"] == 0 and doc["cases"][0]["status"] == "beyond"
    assert exit_status(doc, "oracle") == 1 and exit_status(doc, "bitwise") == 1
    text = render_text(doc, "oracle")
    assert text[0] == ("verdict changed: torch-ddp|ddp/fake/mlp/w2/fp32: passed -> failed "
                       "(rank 1: gradients differ from the oracle) [fails the gate]")
    back = compare(open_recording(str(tmp_path / "b")), base)  # failed -> passed: said, not a gate failure
    assert back["verdict_changes"][0]["fails_gate"] is False and exit_status(back, "oracle") == 0


def test_two_adapters_of_one_recording_pair_by_scenario(tmp_path):
    base = open_recording(record_dir(tmp_path / "a", {"torch-ddp": two_ranks(),
                                                      "refimpl-ddp": {0: nudged(ddp_record()), 1: nudged(ddp_record())}}))
    doc = compare(base, base, adapters=["torch-ddp", "refimpl-ddp"])
    assert doc["cases"][0]["case"] == "torch-ddp vs refimpl-ddp | ddp/fake/mlp/w2/fp32"
    assert doc["first"]["name"] == "w" and doc["summary"]["within"] == 1
    with pytest.raises(RecordingError, match="holds no case of adapter 'torch-fsdp'; it recorded refimpl-ddp, torch-ddp"):
        compare(base, base, adapters=["torch-ddp", "torch-fsdp"])


def test_nothing_comparable_is_bad_input(tmp_path):
    base = open_recording(record_dir(tmp_path / "a", {"torch-ddp": two_ranks()}))
    other = open_recording(record_dir(tmp_path / "b", {"refimpl-ddp": two_ranks()}))
    with pytest.raises(RecordingError, match="nothing comparable"):
        compare(base, other)


def test_the_command_exits_0_1_2_and_writes_json_and_html(tmp_path, capsys):
    from conformance.frontends.cli import main

    a = record_dir(tmp_path / "a", {"torch-ddp": two_ranks()})
    b = record_dir(tmp_path / "b", {"torch-ddp": {0: nudged(ddp_record()), 1: nudged(ddp_record())}})
    out = str(tmp_path / "cmp")
    assert main(["compare", a, a, "--report-dir", out]) == 0
    assert main(["compare", a, b, "--report-dir", out]) == 1
    assert main(["compare", a, b, "--report-dir", out, "--tolerance", "oracle"]) == 0
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert doc["tolerance"] == "oracle" and doc["exit_status"] == 0 and doc["first"]["name"] == "w"
    page = (tmp_path / "cmp" / "compare.html").read_text()
    assert "<svg" in page and "step 0 step" in page
    capsys.readouterr()
    for args, needle in (([str(tmp_path / "nope"), a], "is not a directory"),
                         ([a], "pass NEW (a second recording), or --adapters A B"),
                         ([str(tmp_path), a], "holds no recording.json")):
        assert main(["compare", *args, "--report-dir", out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0]
