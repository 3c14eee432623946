"""The divergence picture of a failing case: modules × events, coloured by how far outside the rule.

Rows are modules (a parameter's name without its last part: `h.5.mlp.c_fc`), in the model's
order; a cell is the worst of the module's tensors at that event (each backward's gradients,
each step's parameters), in ulps outside the case's rule (`conformance.judge.divergence`). So a
100-tensor model reads as a few dozen rows, and "layer 5's expert weights, from step 2" is a
red block starting in column "s2 m0" on the rows `moe.5.experts.*`. The first cell out of its
rule is outlined; every cell's tooltip names the tensor and the distance.
"""

from __future__ import annotations

import html
import math

# (upper bound in ulps, colour, legend) from within the rule to far outside it
SCALE = [
    (0.0, "#e8f5e9", "within the rule"),
    (1e1, "#fff59d", "≤ 10 ulps"),
    (1e3, "#ffcc80", "≤ 10³"),
    (1e5, "#ff8a65", "≤ 10⁵"),
    (1e7, "#e53935", "≤ 10⁷"),
    (math.inf, "#7f0000", "> 10⁷ ulps"),
]
STRUCTURAL = ("#212121", "structural (None vs a tensor, dtype, shape)")
CSS = """
table.dv{border-collapse:collapse;font-size:11px;margin:4px 0 12px}
table.dv td{border:1px solid #fff;width:16px;height:14px;padding:0}
table.dv td.m{width:auto;padding:0 6px;white-space:nowrap;font-family:monospace;border:none}
table.dv th{font-weight:normal;font-size:10px;writing-mode:vertical-rl;transform:rotate(180deg);height:5.5em;
  background:none;position:static;padding:2px;border:none}
table.dv td.first{outline:2px solid #1565c0;outline-offset:-2px}
p.dvlegend span{display:inline-block;padding:1px 6px;margin-right:4px;font-size:11px;border:1px solid #ccc}
"""


def _colour(value: float) -> str:
    if value < 0:
        return STRUCTURAL[0]
    return next(colour for bound, colour, _ in SCALE if value <= bound)


def _modules(tensors: list[str]) -> list[tuple[str, list[int]]]:
    """Tensor indices grouped by module path, in first-appearance (registration) order."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(tensors):
        groups.setdefault(name.rpartition(".")[0] or "(root)", []).append(i)
    return list(groups.items())


def picture(divergence: dict) -> str:
    """The HTML table of one case's divergence map (see the module doc)."""
    e = lambda text: html.escape(str(text), quote=True)  # noqa: E731
    events, tensors, cells = divergence["events"], divergence["tensors"], divergence["cells"]
    first = divergence.get("first") or {}
    head = "".join(f"<th>{e(label)}</th>" for label in events)
    rows = []
    for module, members in _modules(tensors):
        tds = []
        for j, label in enumerate(events):
            worst_i = max(members, key=lambda i: cells[j][i] if cells[j][i] >= 0 else math.inf)
            value = cells[j][worst_i]
            bad = [tensors[i].rpartition(".")[2] for i in members if cells[j][i] != 0.0]
            tip = (f"{module} at {label}: " + (f"worst {tensors[worst_i].rpartition('.')[2]} "
                   + ("structural mismatch" if value < 0 else f"{value:.3g} ulps outside") + f" ({', '.join(bad)} out)"
                   if bad else "within the rule"))
            mark = ' class="first"' if first.get("event") == j and first.get("tensor") in [tensors[i] for i in members] else ""
            tds.append(f'<td{mark} style="background:{_colour(value)}" title="{e(tip)}"></td>')
        rows.append(f'<tr><td class="m">{e(module)}</td>{"".join(tds)}</tr>')
    legend = "".join(f'<span style="background:{c};color:{"#fff" if i >= 4 else "#222"}">{e(t)}</span>'
                     for i, (_, c, t) in enumerate(SCALE))
    legend += f'<span style="background:{STRUCTURAL[0]};color:#fff">{e(STRUCTURAL[1])}</span>'
    where = ""
    if first:
        where = (f" First out of its rule: <b>{e(first['tensor'])}</b> at <b>{e(events[first['event']])}</b>"
                 " (outlined).")
    return (f"<p><b>Where it diverged</b> (rank {divergence.get('rank', 0)}; {len(tensors)} tensors in "
            f"{len(_modules(tensors))} modules × {len(events)} events; {e(divergence.get('unit', ''))}: "
            f"{e(divergence.get('rule', ''))}; each step judged from the engine's own state).{where}</p>"
            f'<p class="dvlegend">{legend}</p>'
            f'<table class="dv"><tr><th></th>{head}</tr>{"".join(rows)}</table>')


def for_result(result: dict) -> str:
    divergence = (result.get("details") or {}).get("divergence")
    return picture(divergence) if divergence and divergence.get("cells") else ""
