"""`gradparity compare BASE NEW`: what moved between two recordings, case by case, tensor by tensor.

The upgrade gate (docs/upgrade-gate.md): record a run on the current torch/engine, record it
again on the candidate, compare. Two runs that pass the oracle can still differ — the oracle
accepts a summation order it cannot predict at 3+ ranks, and rounding in low precision — and
a platform team wants to see those drifts before they ship, not only the breakages.

For every case both recordings hold, every tensor (matched by point, step, micro-batch, kind,
name and rank) is one of:

- bitwise   the same digest;
- within    different bits, but the new value is accepted by the rule the oracle derived for
            that tensor's case and step in NEW (the envelope of its summation orders, or the
            bound from its shares; `recording.oracle_expected` stores it): the drift a team may
            accept (`--tolerance oracle`). Never the straight-through band: where no derived
            rule is recorded (an older recording, a case that failed there), only equality passes;
            a plain band survives only where the oracle itself judged by one;
- beyond    outside that rule, or a tensor present on one side only (None on one side, a
            run that stopped earlier, another dtype or shape).

A case is the worst of its tensors; a case that passed in BASE and failed in NEW (failed,
error, xfailed) fails the gate whatever its tensors say, and verdict changes are printed first.
Exit status: 0 every common tensor bitwise (with `--tolerance oracle`: none beyond) and no
verdict worse; 1 otherwise, after printing the first diverging case, step and tensor and a line per case; 2 bad input or nothing comparable (one line: what to do).
Cases recorded on one side only are listed, never silently dropped.

`--adapters A B` pairs cases by scenario instead of by case id: A's cases in BASE against B's
in NEW, or in BASE itself when NEW is omitted — "is my engine bitwise torch?" in one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from conformance.recording import Recording, RecordingError, open_recording

SCHEMA = "gradparity.compare/1"
FILES = ("compare.json", "compare.html")
RANK = {"bitwise": 0, "within": 1, "beyond": 2}
EPILOG = """\
Exit status: 0 every common tensor bitwise equal (--tolerance oracle: none beyond the rule the
oracle derived for its case and step) and no case went from passed to failed; 1 otherwise
(verdict changes, then the first diverging case, step and tensor are printed first);
2 bad input, or nothing comparable. Writes compare.json and compare.html into --report-dir."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", help="a recording directory (`gradparity run --record DIR`)")
    p.add_argument("new", nargs="?", help="the recording to compare with BASE (omit with --adapters: within BASE)")
    p.add_argument("--adapters", nargs=2, metavar=("A", "B"),
                   help="pair A's cases (BASE) with B's (NEW, or BASE) by scenario: is engine B bitwise engine A?")
    p.add_argument("--tolerance", choices=("bitwise", "oracle"), default="bitwise",
                   help="what passes: bitwise (default), or oracle: differences within the oracle's rule pass")
    p.add_argument("--report-dir", default="gradparity-reports/compare", help="where compare.json and compare.html go")


# -- one tensor ------------------------------------------------------------------------------
_INT_VIEW = {torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF), torch.float32: (torch.int32, 0x7FFFFFFF),
             torch.float16: (torch.int16, 0x7FFF), torch.bfloat16: (torch.int16, 0x7FFF)}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many representable values lie between a and b (float64; inf when one is NaN).

    The bit patterns, read as sign-magnitude integers, are ordered like the floats they encode,
    so their difference counts the floats between (+0 and -0 are 0 apart)."""
    if a.dtype not in _INT_VIEW:
        return (a.double() - b.double()).abs()
    view, magnitude = _INT_VIEW[a.dtype]

    def ordered(t):
        i = t.contiguous().view(view).long()
        return torch.where(i < 0, -(i & magnitude), i)

    oa, ob = ordered(a), ordered(b)
    wide = (oa.double() - ob.double()).abs()  # float64 bit patterns: exact while the int64 difference cannot wrap
    d = torch.where(wide < 2.0**62, (oa - ob).abs().double(), wide)
    nan_a, nan_b = a.isnan(), b.isnan()
    d = torch.where(nan_a & nan_b, torch.zeros_like(d), d)
    return torch.where(nan_a ^ nan_b, torch.full_like(d, math.inf), d)


def derived_accepts(derived: dict, actual: torch.Tensor) -> bool:
    """Is `actual` what the oracle accepted at its case and step (`recording.oracle_expected`):
    the bitwise value, one of an envelope's summation orders, or within its derived bound?"""
    from conformance.oracle.envelope import Envelope

    if "digest" in derived:  # bitwise to the value recorded at that point
        from conformance.recording import digest

        return digest(actual) == derived["digest"]
    candidates = derived.get("candidates")
    if "values" in derived:
        candidates = derived["values"].unsqueeze(0)
    center, radius = derived.get("center"), derived.get("radius")
    reference = candidates[0] if candidates is not None else center.to(actual.dtype)
    if reference.shape != actual.shape:
        return False
    env = Envelope(reference, "recorded", "", candidates=candidates, center=center, radius=radius)
    return bool(env.accepts(actual).all())


def accepts(rule: dict, expected: torch.Tensor, actual: torch.Tensor, derived: dict | None = None) -> bool:
    """Does the oracle's rule accept `actual` where BASE holds `expected`?

    With the rule the oracle derived for this case and step (`derived`: NEW's own, from its
    shares), that rule decides. A rule judged per element against the ranks' shares is never
    replaced by its straight-through band: without a derived rule recorded, only equality passes."""
    if derived is not None:
        return derived_accepts(derived, actual)
    e, a = expected.double(), actual.double()
    kind = rule.get("kind")
    if "between_runs" in rule:  # derived per step, but not recorded (an older recording, a case that failed)
        return bool(((e == a) | (e.isnan() & a.isnan())).all())
    if kind in ("band", "elementwise"):
        return bool(torch.isclose(a, e, rtol=rule["rtol"], atol=rule["atol"], equal_nan=True).all())
    if kind == "norm":
        if a.isnan().any() or e.isnan().any():
            return False
        bound = rule["norm_rtol"] * float(e.norm()) + rule["atol"] * max(1, e.numel()) ** 0.5
        return float((a - e).norm()) <= bound
    # bitwise (and any rule this version does not know): equal values, NaN where NaN
    return bool(((e == a) | (e.isnan() & a.isnan())).all())


def tensor_diff(base: torch.Tensor | None, new: torch.Tensor | None, rule: dict, derived: dict | None = None) -> dict:
    """How two values of one tensor differ: status, elements differing, max ulps/abs/relative."""
    out = {"status": "beyond", "differing": None, "numel": None, "max_ulps": None, "max_abs": None, "max_rel": None}
    if base is None or new is None:
        return out | {"why": f"None in {'BASE' if base is None else 'NEW'}, a tensor in {'NEW' if base is None else 'BASE'}"}
    if base.dtype != new.dtype or base.shape != new.shape:
        return out | {"why": f"{base.dtype}{list(base.shape)} in BASE, {new.dtype}{list(new.shape)} in NEW"}
    floating = base.is_floating_point()
    ulps = ulp_distance(base, new)
    if base.dtype in _INT_VIEW:  # bit patterns: -0.0 against +0.0 differs
        view = _INT_VIEW[base.dtype][0]
        differing = int((base.contiguous().view(view) != new.contiguous().view(view)).sum())
    else:
        differing = int((base != new).sum())
    b, n = base.double(), new.double()
    same = (b == n) | (b.isnan() & n.isnan())  # inf against inf, NaN against NaN: no difference to weigh
    diff = torch.where(same, torch.zeros_like(b), (b - n).abs().nan_to_num(math.inf))
    scale = torch.maximum(b.abs(), n.abs()).nan_to_num(math.inf)
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / scale.clamp_min(torch.finfo(torch.float64).tiny))
    rel = torch.where(diff.isinf(), diff, rel)  # NaN or inf against a number: infinitely far
    out.update(differing=differing, numel=base.numel(), max_ulps=_num(ulps.max()) if ulps.numel() else 0.0,
               max_abs=_num(diff.max()) if diff.numel() else 0.0, max_rel=_num(rel.max()) if rel.numel() else 0.0)
    ok = accepts(rule, base, new, derived) if floating else differing == 0
    out["status"] = "within" if ok else "beyond"
    judged_by = (DERIVED if derived is not None else
                 f"{rule.get('describe')} (no rule derived for this step is recorded: only equality passes)"
                 if "between_runs" in rule else rule.get("describe"))
    out["why"] = f"{differing} of {base.numel()} elements differ" + ("" if ok else f", beyond {judged_by}")
    return out


DERIVED = "the rule the oracle derived for this case and step (from NEW's own shares)"


def _num(x) -> float | str:
    """A JSON-safe number ("inf" for an infinite one: NaN against a number)."""
    x = float(x)
    return "inf" if math.isinf(x) else x


def _val(x) -> float:
    return math.inf if x == "inf" else (x or 0.0)


# -- one case --------------------------------------------------------------------------------
def _key(e: dict) -> tuple:
    return (e["point"], e["step"], e["micro"], e["kind"], e["name"], e["rank"])


def point_label(point: str, step, micro) -> str:
    where = "construction" if point == "init" else f"step {step} {point}"
    return where + (f" (micro-batch {micro})" if micro else "")


def tensor_label(key: tuple) -> str:
    return f"{point_label(*key[:3])}: {key[3]} {key[4]} (rank {key[5]})"


def compare_case(b: dict, n: dict) -> dict:
    """Every tensor of one case, BASE against NEW, in BASE's training order (NEW-only ones last)."""
    bmap, nmap = {_key(e): e for e in b["entries"]}, {_key(e): e for e in n["entries"]}
    keys = list(bmap) + [k for k in nmap if k not in bmap]
    points: dict[tuple, dict] = {}
    tensors, first, counts = [], None, {"bitwise": 0, "within": 0, "beyond": 0}
    for k in keys:
        eb, en = bmap.get(k), nmap.get(k)
        if eb is not None and en is not None and eb["digest"] == en["digest"]:
            d = {"status": "bitwise"}
        elif eb is None or en is None:
            d = {"status": "beyond", "why": f"recorded in {'NEW' if eb is None else 'BASE'} only"}
        else:
            rule = b["rules"][eb["rule"]]
            derived = (n.get("oracle") or {}).get("|".join(str(x) for x in k))
            if derived is None and k[3] in UNJUDGED and "between_runs" in rule:
                rule = rule["between_runs"] | {"describe": f"{rule['between_runs'].get('describe')} "
                                                            f"(the oracle does not judge a {k[3]}: the straight-through band)"}
            d = tensor_diff(b["tensors"].get(eb["digest"]), n["tensors"].get(en["digest"]), rule, derived)
            d["rule"] = DERIVED if derived is not None else rule.get("describe")
        counts[d["status"]] += 1
        p = points.setdefault(k[:3], {"label": point_label(*k[:3]), "step": k[1], "tensors": 0, "differing": 0,
                                      "max_ulps": 0.0, "max_rel": 0.0, "status": "bitwise"})
        p["tensors"] += 1
        if d["status"] != "bitwise":  # ulps and relative terms only where both sides hold comparable values
            p["differing"] += 1
            p["max_ulps"] = _num(max(_val(p["max_ulps"]), _val(d.get("max_ulps"))))
            p["max_rel"] = _num(max(_val(p["max_rel"]), _val(d.get("max_rel"))))
            p["status"] = max(p["status"], d["status"], key=RANK.get)
            row = {"tensor": tensor_label(k), "point": p["label"], "kind": k[3], "name": k[4], "rank": k[5]} | d
            tensors.append(row)
            first = first or row
    status = "beyond" if counts["beyond"] or worse(b["verdict"], n["verdict"]) else \
        "within" if counts["within"] else "bitwise"
    return {"status": status, "counts": counts, "first": first, "points": list(points.values()),
            "max_ulps": _num(max((_val(t.get("max_ulps")) for t in tensors), default=0.0)),
            "max_rel": _num(max((_val(t.get("max_rel")) for t in tensors), default=0.0)),
            "tensors": tensors[:200], "more_tensors": max(0, len(tensors) - 200),
            "verdicts": [b["verdict"], n["verdict"]], "rules": [r.get("describe") for r in b["rules"][:1]]}


NOT_PASSED = ("failed", "error", "xfailed")
UNJUDGED = ("loss", "output")  # recorded for the reader; the oracle judges gradients, parameters and buffers


def worse(base_verdict: str, new_verdict: str) -> bool:
    """A case that passed in BASE and did not in NEW: the gate fails, whatever the tensors say."""
    return base_verdict == "passed" and new_verdict in NOT_PASSED


# -- two recordings --------------------------------------------------------------------------
def _pairs(base: Recording, new: Recording, adapters) -> tuple[list[tuple], list[str], list[str]]:
    """[(label, BASE case id, NEW case id)], BASE-only and NEW-only case ids."""
    if adapters:
        a, b = adapters
        left = {d["scenario"]: cid for cid, d in base.cases.items() if d["adapter"] == a}
        right = {d["scenario"]: cid for cid, d in new.cases.items() if d["adapter"] == b}
        for name, side, rec in ((a, left, base), (b, right, new)):
            if not side:
                recorded = sorted({d["adapter"] for d in rec.cases.values()})
                raise RecordingError(f"{rec.directory!r} holds no case of adapter {name!r}; it recorded "
                                     f"{', '.join(recorded) or 'no case'}: pass one of those to --adapters")
        label = lambda s: f"{a} vs {b} | {s}"  # noqa: E731
    else:
        left = {cid: cid for cid in base.cases}
        right = {cid: cid for cid in new.cases}
        label = lambda s: s  # noqa: E731
    common = [(label(k), left[k], right[k]) for k in sorted(left) if k in right]
    return common, [left[k] for k in sorted(left) if k not in right], [right[k] for k in sorted(right) if k not in left]


def compare(base: Recording, new: Recording, *, adapters=None) -> dict:
    """The comparison document (compare.json); raises RecordingError when nothing is comparable."""
    common, only_base, only_new = _pairs(base, new, adapters)
    cases, not_run, changed = [], [], []
    for label, bid, nid in common:
        b, n = base.cases[bid], new.cases[nid]
        if b["verdict"] != n["verdict"]:
            changed.append({"case": label, "verdicts": [b["verdict"], n["verdict"]], "fails_gate": worse(b["verdict"], n["verdict"]),
                            "message": (n.get("message") or [""])[0] if isinstance(n.get("message"), list) else n.get("message") or ""})
        if (not b["entries"] or not n["entries"]) and "skipped" in (b["verdict"], n["verdict"]) \
                or not b["entries"] and not n["entries"]:
            # Skipped on a side (a capability, a device), or no tensor on either: nothing to weigh, listed.
            # A side that ran and recorded nothing else (it raised, a rank died) is compared: beyond.
            not_run.append({"case": label, "verdicts": [b["verdict"], n["verdict"]]})
            continue
        cases.append({"case": label, "base_case": bid, "new_case": nid} | compare_case(b, n))
    if not cases and not any(c["fails_gate"] for c in changed):
        raise RecordingError(
            f"nothing comparable: BASE ({len(base.cases)} cases) and NEW ({len(new.cases)} cases) share no case with "
            f"recorded tensors ({len(common)} common, none ran on both sides); record the same selection twice"
            + ("" if adapters else ", or pass --adapters A B"))
    summary = {s: sum(c["status"] == s for c in cases) for s in RANK}
    first = next((c for c in cases if c["status"] != "bitwise" and c["first"]), None)
    return {
        "schema": SCHEMA, "base": _side(base), "new": _side(new), "adapters": list(adapters or []),
        "summary": summary | {"compared": len(cases), "not_run": len(not_run), "only_base": len(only_base),
                              "only_new": len(only_new)},
        "first": None if first is None else {"case": first["case"]} | first["first"],
        "cases": cases, "not_run": not_run, "only_base": only_base, "only_new": only_new,
        "verdict_changes": sorted(changed, key=lambda c: not c["fails_gate"]),
    }


def _side(rec: Recording) -> dict:
    p = rec.provenance
    return {"directory": rec.directory, "complete": rec.index.get("complete"), "stopped": rec.index.get("stopped"),
            "torch": p.get("torch"), "suite_version": p.get("suite_version"), "commit": p.get("commit"),
            "dirty": p.get("dirty"), "command": p.get("command"), "device": p.get("device"),
            "adapter_versions": p.get("adapter_versions") or {}, "cases": len(rec.cases),
            "ran_on": sorted({d["where"] for d in rec.cases.values() if d.get("where")})}  # world/backend/device


def exit_status(doc: dict, tolerance: str) -> int:
    failing = doc["summary"]["beyond"] + (doc["summary"]["within"] if tolerance == "bitwise" else 0)
    return 1 if failing or any(c["fails_gate"] for c in doc.get("verdict_changes", ())) else 0


# -- output ----------------------------------------------------------------------------------
def _fmt(x) -> str:
    return "inf" if x == "inf" else f"{x:.3g}"


def render_text(doc: dict, tolerance: str) -> list[str]:
    lines = [f"verdict changed: {c['case']}: {c['verdicts'][0]} -> {c['verdicts'][1]}"
             + (f" ({c['message']})" if c["message"] else "") + (" [fails the gate]" if c["fails_gate"] else "")
             for c in doc.get("verdict_changes", ())]
    for side in ("base", "new"):
        s = doc[side]
        versions = ", ".join(f"{k} {v}" for k, v in s["adapter_versions"].items())
        lines.append(f"{side.upper():4} {s['directory']}: torch {s['torch']}, suite {s['suite_version']} "
                     f"@{(s['commit'] or 'unknown')[:10]}{' (dirty)' if s['dirty'] else ''}; {versions}; "
                     f"ran on {', '.join(s['ran_on']) or 'unknown'}"
                     + ("" if s["complete"] else f"  [INCOMPLETE: {s['stopped'] or 'the run did not finish'}]"))
    f = doc["first"]
    if f is None:
        lines.append("every common tensor is bitwise equal")
    else:
        nums = f" (max {_fmt(f['max_ulps'])} ulps, relative {_fmt(f['max_rel'])})" if f.get("max_ulps") is not None else ""
        lines.append(f"first divergence: {f['case']} at {f['point']}: {f['kind']} {f['name']} (rank {f['rank']}): "
                     f"{f['why']}{nums} [{f['status']}]")
    sm = doc["summary"]
    lines.append(f"per case ({sm['compared']} compared: {sm['bitwise']} bitwise, {sm['within']} within the oracle's "
                 f"rule, {sm['beyond']} beyond it):")
    width = max((len(c["case"]) for c in doc["cases"]), default=0)
    for c in sorted(doc["cases"], key=lambda c: -RANK[c["status"]]):
        f = c["first"]
        where = f"parts at {f['point']}, {f['kind']} {f['name']}" if f else ""
        if f and f.get("max_ulps") is None:  # no values to weigh: say why (one side only, None, another shape)
            where += f" ({f['why']})"
        weighed = any(t.get("max_ulps") is not None for t in c["tensors"])
        nums = f"max {_fmt(c['max_ulps'])} ulps, rel {_fmt(c['max_rel'])}" if weighed else ""
        verdicts = "" if c["verdicts"][0] == c["verdicts"][1] else f"verdict {c['verdicts'][0]} -> {c['verdicts'][1]}"
        lines.append(f"  {c['status']:7}  {c['case']:{width}}  " + "; ".join(x for x in (where, nums, verdicts) if x))
    for key, what in (("only_base", "recorded in BASE only"), ("only_new", "recorded in NEW only")):
        if doc[key]:
            lines.append(f"{len(doc[key])} case(s) {what}: {', '.join(doc[key][:20])}"
                         + (f" ... and {len(doc[key]) - 20} more" if len(doc[key]) > 20 else ""))
    if doc["not_run"]:
        lines.append(f"{len(doc['not_run'])} common case(s) not compared (skipped on a side, or no tensor on either): "
                     + ", ".join(f"{c['case']} ({' / '.join(c['verdicts'])})" for c in doc["not_run"][:10])
                     + (" ..." if len(doc["not_run"]) > 10 else ""))
    return lines


def write(report_dir: str, doc: dict) -> dict[str, str]:
    from conformance.report.compare_html import render

    os.makedirs(report_dir, exist_ok=True)
    paths = {}
    for name, text in ((FILES[0], json.dumps(doc, indent=2)), (FILES[1], render(doc))):
        path = os.path.join(report_dir, name)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
        paths[name] = path
    return paths


def cmd_compare(args) -> int:
    from conformance.validation import UsageError, check_report_dir

    if args.new is None and not args.adapters:
        raise UsageError("pass NEW (a second recording), or --adapters A B to compare two adapters of BASE")
    check_report_dir(args.report_dir)
    t0 = time.perf_counter()
    try:
        base = open_recording(args.base)
        new = base if args.new is None else open_recording(args.new)
        doc = compare(base, new, adapters=args.adapters)
    except RecordingError as exc:
        raise UsageError(str(exc)) from None
    code = exit_status(doc, args.tolerance)
    doc.update(tolerance=args.tolerance, exit_status=code, seconds=round(time.perf_counter() - t0, 3))
    paths = write(args.report_dir, doc)
    for line in render_text(doc, args.tolerance):
        print(line)
    print(f"compare json: {paths[FILES[0]]}\ncompare html: {paths[FILES[1]]}")
    worse = [c["case"] for c in doc.get("verdict_changes", ()) if c["fails_gate"]]
    why = (f"{len(worse)} case(s) went from passed to failed" if worse else
           "every common tensor bitwise equal" if not code and doc["first"] is None else
           "differences within the oracle's rule only (--tolerance oracle)" if not code else
           "tensors moved beyond the oracle's rule" if doc["summary"]["beyond"] else "tensors moved (bitwise gate)")
    print(f"exit {code}: {why} ({doc['seconds']:.2f}s)", file=sys.stderr if code else sys.stdout)
    return code
