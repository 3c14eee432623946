"""Recordings: every tensor a run judged, per case, step and tensor, with digests and provenance.

`gradparity run … --record DIR` (and `gradparity zoo --record`, and the torchrun launcher's
`--record`) hands a `Recorder` to the case pipeline (`conformance.pipeline.run_case`), which
calls `Recorder.add` at the one point where a `CaseResult` is made, so every front end and
every area records the same way. `gradparity compare` (`conformance.frontends.compare_runs`) reads two
recordings back and says what moved.

Why values and not only digests: a digest says *that* a tensor moved, not by how much; the
gate's question ("still inside the oracle's rule?") needs the values. The scenarios' models are
small, so a standard-profile recording is a few MB (docs/upgrade-gate.md has the figures).

Layout of DIR (one run per directory, like the report directory: a new recording removes the
previous one's files by name and touches nothing else):

    recording.json      provenance (torch, engine and suite versions, commit, command, device,
                        backend), `complete` (false while the run goes or if it died), the cases
    cases/<name>.pt     one file per case, `torch.save` of plain data (loadable with
                        `weights_only=True`): the case's metadata, its oracle rules, `entries`
                        (one per case/point/step/tensor/rank, in training order, each with its
                        digest) and `tensors` (digest -> value: a tensor equal on every rank, or
                        unchanged by a step, is stored once), packed ([Note: packed cases])

An entry's `rule` indexes the case's `rules`: what the oracle accepted for that tensor (the
scenario's tolerance, an adapter's declared lossy bound, or bitwise for construction-time
sync), stored as data so an old recording is still judged by the rule it ran under.

Every process of a run may add cases (pytest-xdist workers, zoo threads); only the process that
called `start` writes `recording.json` (`finish`), listing what is in `cases/` then.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field

import torch

SCHEMA = "gradparity.recording/1"
CASE_SCHEMA = "gradparity.recording.case/1"
INDEX, CASES = "recording.json", "cases"
_SUFFIX = ".pt"


class RecordingError(ValueError):
    """A recording that cannot be read or written: the message is one line that says what to do."""


# -- entries: the ranks' records of each area as (point, step, micro, kind, name, rank) -> tensor -
def _events(rank: int, record: dict):
    """ddp and sharded (`conformance.runners.ddp`): construction, every backward, every step."""
    init = record.get("init") or {}
    for kind, key in (("param", "parameters"), ("buffer", "buffers")):
        for name, t in (init.get(key) or {}).items():
            yield "init", None, None, kind, name, rank, t
    for ev in record.get("events") or []:
        point, step, micro = ev["kind"], ev.get("step"), ev.get("micro")
        if ev.get("loss") is not None:
            yield point, step, micro, "loss", "loss", rank, ev["loss"]
        kind = "grad" if point == "backward" else "param"
        for name, t in (ev.get("values") or {}).items():
            yield point, step, micro, kind, name, rank, t
        for name, t in (ev.get("buffers") or {}).items():
            yield point, step, micro, "buffer", name, rank, t


def _rounds(rank: int, record: dict):
    """bucketer: each round's callback values, and the same results read again after flush."""
    for step, rnd in enumerate(record.get("rounds") or []):
        for event in rnd.get("log") or []:
            if event[0] == "callback":
                yield "callback", step, None, "result", f"call {event[1]}", rank, event[2]
        for i, ts in sorted((rnd.get("after_flush") or {}).items()):
            for j, t in enumerate(ts):
                yield "after-flush", step, None, "result", f"call {i}" + (f" #{j}" if j else ""), rank, t


def _passes(rank: int, record: dict):
    """dist_autograd (worker 0 gathers every worker's gradients): each backward pass's gradients."""
    for context in ("main", "after"):
        for step, grads in enumerate((record.get(context) or {}).get("passes") or []):
            for name, t in grads.items():
                yield ("pass" if context == "main" else "next-context-pass"), step, None, "grad", name, rank, t


def _extract(records: dict) -> list[tuple]:
    rows = []
    for rank, record in sorted(records.items()):
        if not isinstance(record, dict):
            continue
        walk = _events if "events" in record or "init" in record else _rounds if "rounds" in record else _passes
        rows.extend(walk(rank, record))
    # Training order first (a rank's whole record is walked in turn above), ranks side by side.
    order = {}
    for row in rows:
        order.setdefault(row[:3], len(order))
    return sorted(rows, key=lambda r: (order[r[:3]], r[5]))


def _from_taps(taps: list) -> list[tuple]:
    return [(t["point"], t["step"], t["micro"], t["kind"], name, 0, value)
            for t in taps for name, value in t["values"].items()]


def digest(t: torch.Tensor | None) -> str:
    """sha256 (128 bits) of dtype, shape and bytes: equal digests mean bitwise-equal tensors."""
    if t is None:
        return "none"
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    head = f"{t.dtype}|{list(t.shape)}|".encode()
    return hashlib.sha256(head + data).hexdigest()[:32]


def _plain(t):
    """A CPU strided tensor (sparse gradients are stored dense: the oracle compares them dense)."""
    if not isinstance(t, torch.Tensor):
        return None
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.to("cpu", copy=True).contiguous()


def rule_of(tol, source: str) -> dict:
    """A `conformance.spec.Tolerance` as data (what `compare --tolerance oracle` applies).

    A rule judged per element against the ranks' own contributions (a summation order, a
    derived bound) cannot be re-applied between two runs without those contributions; between
    runs it is the band the oracle uses for its straight-through check, stored as `between_runs`."""
    kind = getattr(tol, "kind", None) or ("bitwise" if tol.exact else "norm" if tol.norm_rtol is not None else "band")
    rule = {"kind": kind, "describe": tol.describe(), "rtol": tol.rtol, "atol": tol.atol, "norm_rtol": tol.norm_rtol,
            "reason": tol.reason, "source": source}
    band = getattr(tol, "straight_through", None)
    if kind not in ("bitwise", "band", "norm") and band is not None:
        rule["between_runs"] = rule_of(band, "the oracle's straight-through band")
    return rule


def _rules(case, result) -> list[dict]:
    """[the rule the judge applied to this case's tensors, bitwise (construction-time sync)]."""
    from conformance.spec import EXACT

    scenario, tol, source = case.scenario, case.scenario.tolerance, "the scenario's tolerance"
    if scenario.area in ("ddp", "sharded"):  # the judge's own choice (conformance.judge.contract.check_records)
        try:
            from conformance.adapters import registry
            from conformance.semantics import declared

            lossy = declared(registry.load(case.adapter_spec), scenario).lossy
            if lossy is not None:
                tol, source = lossy, "the adapter's declared lossy bound"
        except Exception:  # noqa: BLE001 - a bad adapter is the case's own error; keep the scenario's rule
            pass
    rule = rule_of(tol, source)
    judged = (getattr(result.checked, "details", None) or {}).get("oracle")
    if judged:  # what the judge says it applied (rule, largest bound ...): plain data, as JSON has it
        rule["judge"] = json.loads(json.dumps(judged, default=str))
    return [rule, rule_of(EXACT, "construction: every rank holds rank 0's values")]


def _key(e: dict) -> str:
    return "|".join(str(e[k]) for k in ("point", "step", "micro", "kind", "name", "rank"))


def oracle_expected(judged: dict | None, keys: dict[str, str]) -> dict[str, dict]:
    """What the oracle accepted for each recorded tensor, by entry key: `{"digest": d}` where the
    rule was bitwise and the recorded tensor (digest d) is the value, `{"values": t}` where it was
    bitwise to another value, or an envelope's `candidates` and/or `center` and `radius`
    (conformance.oracle.envelope.Envelope).

    The rule of one case at one step, derived from that run's own shares: `compare --tolerance
    oracle` judges a moved tensor by it, never by the straight-through band. Tensors shared by
    every rank (one envelope object) are stored once by torch.save."""
    from conformance.oracle.envelope import Envelope

    out, copies = {}, {}

    def plain(t):  # one copy per tensor object, however many ranks expect it
        return copies.setdefault(id(t), (t, _plain(t)))[1]

    for key, value in (judged or {}).items():
        k = "|".join(str(x) for x in key)
        if k not in keys or value is None:
            continue
        if isinstance(value, Envelope):
            out[k] = {name: plain(getattr(value, name)) for name in ("candidates", "center", "radius")
                      if getattr(value, name) is not None}
        elif isinstance(value, torch.Tensor):
            same = digest(_plain(value)) == keys[k]  # the usual case: stored once, as the recorded tensor
            out[k] = {"digest": keys[k]} if same else {"values": plain(value)}
    return out


# -- writing -------------------------------------------------------------------------------------
def _file_name(case_id: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", case_id)[:120]
    return f"{safe}-{hashlib.sha1(case_id.encode()).hexdigest()[:8]}{_SUFFIX}"


def _atomic(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def check_directory(path: str) -> None:
    """`--record DIR` must be writable now, not after an hour of running (UsageError otherwise)."""
    from conformance.validation import UsageError

    try:
        os.makedirs(os.path.join(path, CASES), exist_ok=True)
        probe = os.path.join(path, CASES, f".write-check-{os.getpid()}")
        with open(probe, "w", encoding="utf-8"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise UsageError(f"cannot record into {path!r} ({exc.strerror or exc}); pass a writable --record DIR") from None


@dataclass
class Recorder:
    """Writes one run's recording; `add` is safe from any process or thread of the run."""

    directory: str
    started: float = field(default_factory=time.time)
    seconds: float = 0.0  # spent in `add` by this process (the overhead of recording, for the index)

    def start(self, run_info: dict) -> None:
        """Remove the previous recording's files (only those) and say a run is under way."""
        check_directory(self.directory)
        cases = os.path.join(self.directory, CASES)
        for name in os.listdir(cases):
            if name.endswith(_SUFFIX):
                os.remove(os.path.join(cases, name))
        self._write_index(run_info, complete=False)

    def add(self, result, outcome=None, taps: list | None = None, where: str = "") -> str:
        """Record one case (whatever its verdict: a failing run's tensors are what you compare)."""
        t0 = time.perf_counter()
        case = result.case
        rows = _extract(outcome.values) if outcome is not None else []
        rows += _from_taps(taps or [])
        entries, tensors = [], {}
        for point, step, micro, kind, name, rank, value in rows:
            t = _plain(value)
            d = digest(t)
            if t is not None:
                tensors.setdefault(d, t)
            entries.append({"point": point, "step": step, "micro": micro, "kind": kind, "name": name, "rank": rank,
                            "digest": d, "dtype": str(t.dtype).removeprefix("torch.") if t is not None else None,
                            "shape": list(t.shape) if t is not None else None, "rule": 1 if point == "init" else 0})
        errors = {r: (v.get("error") or v.get("crash")) for r, v in (outcome.values if outcome else {}).items()
                  if isinstance(v, dict) and (v.get("error") or v.get("crash"))}
        doc = {
            "schema": CASE_SCHEMA, "case": case.id, "adapter": case.adapter_spec, "scenario": case.scenario.id,
            "area": case.scenario.area, "world_size": case.scenario.world_size, "dtype": case.scenario.dtype,
            "device": case.scenario.device, "where": where, "adapter_version": _adapter_version(case.adapter_spec),
            "verdict": result.verdict, "message": (result.message or "").strip().splitlines()[:1],
            "failure_class": result.failure.failure_class.value if result.failure is not None else None,
            "rank_errors": {str(r): str(e)[:500] for r, e in errors.items()},
            "rules": _rules(case, result), "packed": pack(entries, tensors),
            "oracle": oracle_expected(getattr(result.checked, "expected", None), {_key(e): e["digest"] for e in entries}),
        }
        path = os.path.join(self.directory, CASES, _file_name(case.id))
        _atomic(path, lambda tmp: torch.save(doc, tmp))
        self.seconds += time.perf_counter() - t0
        return path

    def finish(self, run_info: dict, *, stopped: str | None = None) -> dict:
        """Write the index (every case file now present); returns it."""
        return self._write_index(run_info, complete=not stopped, stopped=stopped)

    def _write_index(self, run_info: dict, *, complete: bool, stopped: str | None = None) -> dict:
        cases = os.path.join(self.directory, CASES)
        files = sorted(n for n in os.listdir(cases) if n.endswith(_SUFFIX)) if os.path.isdir(cases) else []
        index = {"schema": SCHEMA, "complete": complete, "stopped": stopped, "started": self.started,
                 "finished": time.time() if complete or stopped else None, "provenance": run_info,
                 "case_files": files, "record_seconds_this_process": round(self.seconds, 3),
                 "bytes": sum(os.path.getsize(os.path.join(cases, n)) for n in files)}
        text = json.dumps(index, indent=2, default=str)

        def write(tmp):
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)

        _atomic(os.path.join(self.directory, INDEX), write)
        return index


# [Note: packed cases] A case holds thousands of entries and tensors of a few bytes each (a
# many-parameter model, every rank, every step): as dicts and one zip record per tensor, the
# bookkeeping was ~60% of a recording. On disk a case is therefore one int32 table (a row per
# entry: point, step, micro, kind, name, rank, tensor, rule; strings as indices into `strings`)
# and one byte blob holding every distinct tensor, sliced by `dtypes`/`shapes`/`offsets`;
# `load_case` unpacks it into the `entries`/`tensors` the rest of the code reads.
_COLUMNS = ("point", "step", "micro", "kind", "name", "rank", "tensor", "rule")


def pack(entries: list[dict], tensors: dict[str, torch.Tensor]) -> dict:
    strings: dict[str, int] = {}
    order = {d: i for i, d in enumerate(tensors)}
    sid = lambda s: strings.setdefault(s, len(strings))  # noqa: E731
    rows = [[sid(e["point"]), -1 if e["step"] is None else e["step"], -1 if e["micro"] is None else e["micro"],
             sid(e["kind"]), sid(e["name"]), e["rank"], order.get(e["digest"], -1), e["rule"]] for e in entries]
    parts = [t.reshape(-1).view(torch.uint8) for t in tensors.values()]
    sizes = [p.numel() for p in parts]
    return {"columns": list(_COLUMNS), "table": torch.tensor(rows, dtype=torch.int32).reshape(-1, len(_COLUMNS)),
            "strings": list(strings), "digests": list(tensors), "blob": torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()], "sizes": sizes}


def unpack(packed: dict) -> tuple[list[dict], dict[str, torch.Tensor]]:
    tensors, offset = {}, 0
    for d, dtype, shape, size in zip(packed["digests"], packed["dtypes"], packed["shapes"], packed["sizes"], strict=True):
        # a copy: a slice at an odd offset cannot be viewed as a wider dtype
        tensors[d] = packed["blob"][offset:offset + size].clone().view(getattr(torch, dtype)).reshape(shape)
        offset += size
    strings, digests, entries = packed["strings"], packed["digests"], []
    for point, step, micro, kind, name, rank, index, rule in packed["table"].tolist():
        t = tensors[digests[index]] if index >= 0 else None
        entries.append({"point": strings[point], "step": None if step < 0 else step, "micro": None if micro < 0 else micro,
                        "kind": strings[kind], "name": strings[name], "rank": rank,
                        "digest": digests[index] if index >= 0 else "none",
                        "dtype": str(t.dtype).removeprefix("torch.") if t is not None else None,
                        "shape": list(t.shape) if t is not None else None, "rule": rule})
    return entries, tensors


def _adapter_version(spec: str) -> str:
    from conformance.adapters import registry
    from conformance.report.run_info import adapter_version

    try:
        return adapter_version(spec, registry.load(spec))
    except Exception:  # noqa: BLE001 - the case itself reports a bad adapter
        return "unknown"


# -- reading -------------------------------------------------------------------------------------
@dataclass
class Recording:
    """A recording directory, read back: `index` (recording.json) and its cases by case id."""

    directory: str
    index: dict
    cases: dict[str, dict]  # case id -> the case's document (entries, tensors, rules, verdict)

    @property
    def provenance(self) -> dict:
        return self.index.get("provenance") or {}


def load_case(path: str) -> dict:
    try:
        doc = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: say which
        raise RecordingError(f"cannot read the recorded case {path!r} ({type(exc).__name__}: {exc}); "
                             "record the run again") from None
    if not isinstance(doc, dict) or doc.get("schema") != CASE_SCHEMA:
        raise RecordingError(f"{path!r} is not a gradparity case recording ({CASE_SCHEMA}); record the run again")
    doc["entries"], doc["tensors"] = unpack(doc.pop("packed"))
    return doc


def open_recording(directory: str) -> Recording:
    """Read `directory`'s index and case headers; RecordingError (one line) when it is none."""
    index_path = os.path.join(directory, INDEX)
    if not os.path.isdir(directory):
        raise RecordingError(f"{directory!r} is not a directory; pass a directory written by `gradparity run --record`")
    try:
        with open(index_path, encoding="utf-8") as fh:
            index = json.load(fh)
    except FileNotFoundError:
        raise RecordingError(f"{directory!r} holds no {INDEX}; pass a directory written by "
                             "`gradparity run --record DIR`") from None
    except (OSError, ValueError) as exc:
        raise RecordingError(f"cannot read {index_path!r} ({exc}); record the run again") from None
    if index.get("schema") != SCHEMA:
        raise RecordingError(f"{index_path!r} has schema {index.get('schema')!r}, not {SCHEMA!r}; "
                             "record both runs with this version of gradparity")
    found = {}
    cases = os.path.join(directory, CASES)
    for name in sorted(os.listdir(cases)) if os.path.isdir(cases) else []:
        if name.endswith(_SUFFIX):
            doc = load_case(os.path.join(cases, name))
            found[doc["case"]] = doc
    return Recording(directory, index, found)
