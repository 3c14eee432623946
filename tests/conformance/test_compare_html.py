"""compare.html (conformance/report/compare_html.py): the page says where each case parts, its
per-step plot is well-formed SVG (one mark per point of training), and nothing recorded is
injected as markup."""

import re
import xml.etree.ElementTree as ET

from conformance.report.compare_html import plot, render


def _point(label, step, ulps, status="within", differing=1):
    return {"label": label, "step": step, "tensors": 3, "differing": differing, "max_ulps": ulps, "max_rel": 1e-7,
            "status": status}


def _doc():
    first = {"point": "step 1 backward", "kind": "grad", "name": "<w>", "rank": 0, "status": "beyond",
             "why": "2 of 4 elements differ", "max_ulps": 3.0, "max_rel": 1e-6, "tensor": "t"}
    moved = {"case": "a|ddp/x<script>", "status": "beyond", "first": first, "max_ulps": "inf", "max_rel": 1e-6,
             "verdicts": ["passed", "failed"], "rules": ["bitwise"], "tensors": [first], "more_tensors": 0,
             "points": [_point("construction", None, 0.0, "bitwise", 0), _point("step 0 backward", 0, 0.0, "bitwise", 0),
                        _point("step 1 backward", 1, 3.0, "beyond"), _point("step 1 step", 1, "inf", "beyond")]}
    same = {"case": "a|ddp/y", "status": "bitwise", "first": None, "points": [], "tensors": [], "verdicts": ["passed"] * 2}
    side = {"directory": "d", "torch": "2.13", "suite_version": "0.1", "commit": None, "adapter_versions": {"a": "1"},
            "complete": True}
    return {"base": side, "new": side | {"complete": False}, "first": {"case": moved["case"]} | first,
            "summary": {"compared": 2, "bitwise": 1, "within": 0, "beyond": 1}, "cases": [moved, same],
            "only_base": ["a|ddp/z"], "only_new": [], "tolerance": "bitwise", "exit_status": 1}


def test_the_plot_is_svg_with_a_mark_per_point():
    points = _doc()["cases"][0]["points"]
    svg = ET.fromstring(plot(points))
    circles = [e for e in svg.iter() if e.tag.endswith("circle")]
    assert len(circles) == len(points)
    ys = [float(c.get("cy")) for c in circles]
    assert ys[0] == ys[1] > ys[2] > ys[3]  # 0, 0, 3 ulps, then NaN against a number (drawn at the top)
    assert [c.get("fill") for c in circles][-1] == "#c62828"


def test_the_page_names_where_each_case_parts_and_escapes_what_was_recorded():
    page = render(_doc())
    assert "<script>" not in page and "&lt;script&gt;" in page and "&lt;w&gt;" in page
    assert "the runs part at <b>step 1 backward</b>" in page and "verdict passed → failed" in page
    assert "INCOMPLETE" in page and "1 case(s) recorded in BASE only" in page
    doc = _doc()
    gone = doc["cases"][0]["tensors"][0]
    for key in ("max_ulps", "max_rel"):
        gone.pop(key)
    gone["why"] = "recorded in BASE only"
    assert "(grad <code>&lt;w&gt;</code>), recorded in BASE only — verdict" in render(doc)  # no ulps made up
    for svg in re.findall(r"<svg.*?</svg>", page, flags=re.S):
        ET.fromstring(svg)
