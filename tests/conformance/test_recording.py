"""Recordings (conformance/recording.py): what a case's records become on disk, and back.

Fast: fake cases, fake rank records, no process group. The real thing (a w3 world, two engines)
is tests/conformance/test_recording_engines.py."""

import json
import os

import pytest
import torch

from conformance import case as case_module
from conformance.area import Area
from conformance.case import Case
from conformance.harness.pool import TaskOutcome
from conformance.judge.contract import Checked
from conformance.pipeline import CaseResult, run_case
from conformance.recording import (
    CASES,
    INDEX,
    Recorder,
    RecordingError,
    digest,
    load_case,
    open_recording,
)
from conformance.runners.recording_tap import tap, tapping
from conformance.spec import Scenario, float_tolerance

SCENARIO = Scenario(id="ddp/fake/mlp/w2/fp32", area="ddp", model="mlp", world_size=2,
                    tolerance=float_tolerance("float32", 2))


def ddp_record(scale: float = 1.0, *, rank_bias: float = 0.0) -> dict:
    """A rank's record as conformance.runners.ddp writes it: construction, a backward, a step."""
    w, b = torch.arange(6.0).reshape(2, 3), torch.ones(2)
    return {"init": {"parameters": {"w": w, "b": b}, "buffers": {"running": torch.zeros(2)}},
            "events": [{"kind": "backward", "step": 0, "micro": 0, "synced": True, "loss": torch.tensor(2.5 + rank_bias),
                        "values": {"w": w * scale, "b": None}},
                       {"kind": "step", "step": 0, "values": {"w": w - scale, "b": b}, "buffers": {"running": torch.ones(2)}}],
            "error": None}


def result_of(case: Case, records: dict) -> tuple[CaseResult, TaskOutcome]:
    return CaseResult(case, "passed", checked=Checked(1)), TaskOutcome("fake", values=records)


def test_a_case_round_trips_in_training_order_with_digests(tmp_path):
    rec = Recorder(str(tmp_path))
    rec.start({"torch": torch.__version__})
    result, outcome = result_of(Case(SCENARIO, "torch-ddp"), {0: ddp_record(), 1: ddp_record(rank_bias=1.0)})
    path = rec.add(result, outcome, where="w2/gloo/cpu")
    doc = load_case(path)
    keys = [(e["point"], e["step"], e["kind"], e["name"], e["rank"]) for e in doc["entries"]]
    assert keys[:6] == [("init", None, "param", "w", 0), ("init", None, "param", "b", 0), ("init", None, "buffer", "running", 0),
                        ("init", None, "param", "w", 1), ("init", None, "param", "b", 1), ("init", None, "buffer", "running", 1)]
    assert keys[6:10] == [("backward", 0, "loss", "loss", 0), ("backward", 0, "grad", "w", 0), ("backward", 0, "grad", "b", 0),
                          ("backward", 0, "loss", "loss", 1)]
    assert keys[-1] == ("step", 0, "buffer", "running", 1)
    none = next(e for e in doc["entries"] if e["name"] == "b" and e["point"] == "backward")
    assert none["digest"] == "none" and none["dtype"] is None
    # Equal tensors (every rank's, and unchanged ones) are stored once; each entry's value is its digest's.
    assert len(doc["tensors"]) < len(doc["entries"])
    for e in doc["entries"]:
        if e["digest"] != "none":
            assert digest(doc["tensors"][e["digest"]]) == e["digest"]
    # The oracle's rule travels with the tensors: the scenario's for training, bitwise for construction.
    assert doc["rules"][0]["kind"] == "band" and doc["rules"][0]["rtol"] == SCENARIO.tolerance.rtol
    assert doc["rules"][1]["kind"] == "bitwise"
    assert {e["rule"] for e in doc["entries"] if e["point"] == "init"} == {1}
    assert doc["where"] == "w2/gloo/cpu" and doc["verdict"] == "passed"
    index = rec.finish({"torch": torch.__version__})
    assert index["complete"] and index["case_files"] == [os.path.basename(path)]
    back = open_recording(str(tmp_path))
    assert list(back.cases) == ["torch-ddp|ddp/fake/mlp/w2/fp32"] and back.provenance["torch"] == torch.__version__


def test_packing_keeps_every_dtype_shape_and_none():
    from conformance.recording import pack, unpack

    values = [torch.tensor(True), torch.arange(3, dtype=torch.float16), torch.randn(2, 3), torch.ones(5, dtype=torch.bfloat16),
              torch.arange(4, dtype=torch.int64).reshape(2, 2), torch.randn(1, dtype=torch.float64), torch.empty(0, 3)]
    tensors = {digest(t): t for t in values}  # odd byte offsets between them: the unpacked views must still line up
    entries = [{"point": "step", "step": i, "micro": None, "kind": "param", "name": f"p{i}", "rank": 0, "digest": d,
                "rule": 0} for i, d in enumerate(tensors)]
    entries.append({"point": "init", "step": None, "micro": 2, "kind": "grad", "name": "unused", "rank": 1,
                    "digest": "none", "rule": 1})
    back_entries, back = unpack(pack(entries, tensors))
    assert list(back) == list(tensors)
    for d, t in tensors.items():
        assert back[d].dtype == t.dtype and back[d].shape == t.shape and torch.equal(back[d], t)
    assert [{k: e[k] for k in entries[0]} for e in back_entries] == entries
    assert back_entries[-1]["dtype"] is None and back_entries[0]["shape"] == []


def test_digest_is_bitwise():
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))
    assert digest(torch.tensor([1.0])) != digest(torch.tensor([1.0], dtype=torch.float64))
    assert digest(torch.ones(2, 3)) != digest(torch.ones(3, 2))
    assert digest(torch.ones(2, dtype=torch.bfloat16)) == digest(torch.ones(2, dtype=torch.bfloat16))


def test_start_removes_the_previous_recording_and_nothing_else(tmp_path):
    (tmp_path / "mine.txt").write_text("user file")
    first = Recorder(str(tmp_path))
    first.start({})
    first.add(*result_of(Case(SCENARIO, "torch-ddp"), {0: ddp_record(), 1: ddp_record()}))
    Recorder(str(tmp_path)).start({})
    assert os.listdir(tmp_path / CASES) == [] and (tmp_path / "mine.txt").exists()
    assert json.loads((tmp_path / INDEX).read_text())["complete"] is False  # a run under way, or one that died


def test_other_areas_records_and_taps_become_entries(tmp_path):
    rec = Recorder(str(tmp_path))
    rec.start({})
    bucketer = Scenario(id="bucketer/fake/w2", area="bucketer", model="plan", world_size=2)
    rounds = {"rounds": [{"log": [("enter", 0), ("callback", 0, torch.ones(3)), ("return", 0)],
                          "after_flush": {0: [torch.ones(3)]}}]}
    doc = load_case(rec.add(*result_of(Case(bucketer, "refimpl-bucketer"), {0: rounds, 1: rounds})))
    assert [(e["point"], e["name"], e["rank"]) for e in doc["entries"]] == [
        ("callback", "call 0", 0), ("callback", "call 0", 1), ("after-flush", "call 0", 0), ("after-flush", "call 0", 1)]
    da = Scenario(id="dist_autograd/fake/w2", area="dist_autograd", model="simple", world_size=2)
    record = {"rank": 0, "main": {"passes": [{"w@worker1": torch.ones(2)}, {"w@worker1": torch.full((2,), 2.0)}]}}
    doc = load_case(rec.add(*result_of(Case(da, "refimpl-dist-autograd"), {0: record, 1: {"rank": 1}})))
    assert [(e["point"], e["step"], e["name"]) for e in doc["entries"]] == [("pass", 0, "w@worker1"), ("pass", 1, "w@worker1")]
    with tapping(True) as taps:
        tap("backward", 0, "grad", {"w": torch.ones(2)})
    tap("backward", 0, "grad", {"w": torch.ones(2)})  # outside: nobody is recording, nothing happens
    dp = Scenario(id="data_parallel/fake/w2", area="data_parallel", model="mlp", world_size=2)
    doc = load_case(rec.add(CaseResult(Case(dp, "refimpl-data-parallel"), "passed"), None, taps))
    assert [(e["point"], e["kind"], e["name"]) for e in doc["entries"]] == [("backward", "grad", "w")]


def test_bad_recordings_are_refused_in_one_line(tmp_path):
    with pytest.raises(RecordingError, match="is not a directory"):
        open_recording(str(tmp_path / "missing"))
    with pytest.raises(RecordingError, match="holds no recording.json"):
        open_recording(str(tmp_path))
    (tmp_path / INDEX).write_text(json.dumps({"schema": "other/9"}))
    with pytest.raises(RecordingError, match="record both runs with this version"):
        open_recording(str(tmp_path))
    bad = tmp_path / "x.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(RecordingError, match="cannot read the recorded case"):
        load_case(str(bad))


class FakeExecutor:
    def run(self, area, scenario, adapter_spec):
        return TaskOutcome("fake", values={0: ddp_record(), 1: ddp_record()})

    def where(self, area, scenario):
        return "fake world"


def test_the_pipeline_records_every_case_even_a_failing_one(tmp_path, monkeypatch):
    from conformance.judge.compare import ConformanceError

    def judge(s, spec, records):
        raise ConformanceError("[x] adapter a: rank 0: gradients differ")

    area = Area("ddp", "fake", lambda: [], lambda payload, ctx: None, judge, lambda: None)
    monkeypatch.setattr(case_module, "get_area", lambda name: area)
    rec = Recorder(str(tmp_path))
    rec.start({})
    result = run_case(Case(SCENARIO, "torch-ddp"), FakeExecutor(), rec)
    assert result.verdict == "failed"
    doc = open_recording(str(tmp_path)).cases["torch-ddp|ddp/fake/mlp/w2/fp32"]
    assert doc["verdict"] == "failed" and doc["where"] == "fake world" and len(doc["entries"]) == 2 * 9  # per rank: 3 at construction, 3 per backward, 3 per step
    skipped = run_case(Case(SCENARIO, "refimpl-ddp", skip="lacks capability: x"), None, rec)
    assert skipped.verdict == "skipped"
    assert open_recording(str(tmp_path)).cases["refimpl-ddp|ddp/fake/mlp/w2/fp32"]["entries"] == []


def test_a_recording_that_cannot_be_written_is_an_error_not_a_pass(tmp_path, monkeypatch):
    area = Area("ddp", "fake", lambda: [], lambda payload, ctx: None, lambda s, spec, r: Checked(1), lambda: None)
    monkeypatch.setattr(case_module, "get_area", lambda name: area)
    rec = Recorder(str(tmp_path / "gone"))  # never started: its cases/ directory does not exist
    result = run_case(Case(SCENARIO, "torch-ddp"), FakeExecutor(), rec)
    assert result.verdict == "error" and result.failure.failure_class.value == "infrastructure"
    assert result.failure.cause.startswith("recording failed: ") and "gone" in result.failure.cause


def test_an_unwritable_record_directory_is_bad_input(capsys):
    from conformance.frontends.cli import main

    assert main(["run", "--adapter", "torch-ddp", "--record", "/proc/gradparity/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gradparity: error: cannot record into '/proc/gradparity/x' (No such file or directory); "
                   "pass a writable --record DIR"]
