"""Rendering a health report (``replaydiff.health.HealthReport``): Markdown, and one self-contained HTML file (inline
CSS and an inline SVG plot of the error along the op sequence). They read the report and nothing else. Every string
from the trace is ``shown`` (control characters and newlines as visible escapes) in both."""
from __future__ import annotations

import html
import math
from typing import Any, TextIO

from replaydiff.health import TOP, Check, HealthReport
from replaydiff.rebuild_and_judge import shown
from replaydiff.replay.describe import figure_text, metrics_line, place, planted_line
from replaydiff.replay.result import OpResult
from replaydiff.trace.schema import Environment


def _title(h: HealthReport) -> list[str]:
    lines = []
    if h.planted:
        lines.append(planted_line(h.planted))
    lines.append(f"replaydiff health report: {h.trace}")
    return lines


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(shown(c).replace("|", "\\|") for c in cells) + " |\n"


def _passed(c: Check) -> str:
    return "n/a" if c.passed is None else ("pass" if c.passed else "FAIL")


def render_markdown(h: HealthReport, out: TextIO) -> None:
    title = _title(h)
    if h.planted:
        out.write(f"**{shown(title[0])}**\n\n" + "".join(f"{shown(note)}\n\n" for note in h.plant_notes))
    out.write(f"# {shown(title[-1])}\n\n")
    o = h.options
    out.write(f"Replayed on {o.get('device')} at {o.get('precision')}"
              + (f", reference {o['reference']}" if o.get("reference") else "") + ": "
              + ", ".join(f"{n} {s}" for s, n in h.counts.items()) + "\n\n")
    for w in h.warnings:
        out.write(f"- warning: {shown(w)}\n")
    out.write("## Checks\n\n" + _row(["check", "measured", "limit", "result"]) + _row(["---"] * 4))
    for c in h.checks:
        out.write(_row([c.what, c.measured, c.limit, _passed(c)]))
    out.write("\n## Culprit\n\n")
    if h.culprit is None:
        out.write("No divergent or nondeterministic op.\n")
    else:
        r = h.culprit
        out.write(f"{h.culprit_kind}: **#{r.index} {shown(r.op)}**" + (f" (rank {r.rank})" if r.rank else "") + "\n\n")
        for k, v in _culprit_fields(r):
            out.write(f"- {k}: {shown(v)}\n")
    out.write(f"\n## The {TOP} ops with the largest error / limit\n\n")
    out.write(_row(["op", "name", "module", "phase", "status", "error / limit", "detail"]) + _row(["---"] * 7))
    for r, e in h.top:
        out.write(_row([f"#{r.index}" + (f" r{r.rank}" if r.rank else ""), r.op, r.module or "", r.phase or "",
                        r.status.value, figure_text(e), _detail(r)]))
    out.write("\n## Error per module\n\n")
    out.write(_row(["module", "ops", "divergent", "largest error / limit", "at"]) + _row(["---"] * 5))
    for m in h.modules:
        out.write(_row([m.module, str(m.ops), str(m.divergent), figure_text(m.worst),
                        f"#{m.worst_op.index} {m.worst_op.op}" if m.worst_op else ""]))
    out.write("\n## Likely causes\n\n")
    if not h.causes:
        out.write("None with evidence in this trace and replay.\n")
    for c in h.causes:
        out.write(f"### {shown(c.title)}\n\nEvidence:\n\n" + "".join(f"- {shown(e)}\n" for e in c.evidence)
                  + f"\nRemedy: {shown(c.remedy)}\n\n")
    out.write("\n## Environment" + (f" (rank {h.environment_rank})" if h.environment_rank is not None else "")
              + "\n\n")
    for k, v in _environment_rows(h.environment):
        out.write(f"- {shown(k)}: {shown(v)}\n")


def _detail(r: OpResult) -> str:
    """An op's figures, and for an op within its limits despite figures over the fixed ones, why."""
    why = r.verdict.explanation if r.verdict is not None else None
    return metrics_line(r) + (f"; {why}" if why else "")


def _culprit_fields(r: OpResult) -> list[tuple[str, str]]:
    loc = place(r)
    rows = [("module", loc.module or "-"), ("phase", loc.phase_text or "-"), ("source line", loc.source or "-")]
    ran_by = loc.origin()
    if ran_by is not None:
        rows.append(("ran by", ran_by))
    rows.append(("figures", metrics_line(r)))
    if r.reason:
        rows.append(("reason", r.reason))
    return rows


def _environment_rows(env: Environment) -> list[tuple[str, str]]:
    rows = [(k, str(v)) for k, v in (("torch", env.torch), ("cuda", env.cuda), ("cudnn", env.cudnn),
                                     ("nccl", env.nccl), ("driver", env.driver), ("num_threads", env.num_threads),
                                     ("num_interop_threads", env.num_interop_threads), ("hostname", env.hostname),
                                     ("rank", env.rank), ("world_size", env.world_size), ("platform", env.platform))]
    rows.append(("devices", ", ".join(f"{d.name} (sm {'.'.join(map(str, d.capability))})"
                                      for d in env.devices) or "none (CPU)"))
    for k, v in env.flags.recorded:
        rows.append((k, str(v)))
    for k, v in env.variables.items():
        rows.append((f"${k}", str(v)))
    return rows


# -- HTML -----------------------------------------------------------------------------------------------------------
_CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#f3f3f3}.FAIL{color:#b00;font-weight:bold}.pass{color:#070}.planted{background:#fee;
border:2px solid #b00;padding:.5em;font-weight:bold}code{background:#f6f6f6}svg{border:1px solid #ddd}"""


def _esc(x: Any) -> str:
    return html.escape(shown(x))


def _table(head: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    out = ["<table><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr>"]
    for i, r in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>")
    return "".join(out) + "</table>\n"


def error_plot_svg(points: list[tuple[int, int, float, str]], width: int = 1000, height: int = 260) -> str:
    """Error / limit (log scale) of every judged op along the op sequence; the limit is the dashed line at 1."""
    pad_l, pad_r, pad_t, pad_b = 60, 10, 10, 30
    if not points:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="40"><text x="10" y="25">' \
               f"no op was judged</text></svg>"
    ranks = sorted({p[0] for p in points})
    span = {r: max(p[1] for p in points if p[0] == r) + 1 for r in ranks}
    offset, acc = {}, 0
    for r in ranks:  # ranks side by side along x
        offset[r], acc = acc, acc + span[r]
    lo, hi = -4.0, 4.0  # log10 of error / limit shown; beyond is clipped to the edge

    def x(rank: int, i: int) -> float:
        return pad_l + (offset[rank] + i) / max(1, acc) * (width - pad_l - pad_r)

    def y(e: float) -> float:
        v = hi if math.isinf(e) else (lo if e <= 0 else min(hi, max(lo, math.log10(e))))
        return pad_t + (hi - v) / (hi - lo) * (height - pad_t - pad_b)

    colour = {"divergent": "#c00", "nondeterministic": "#e80", "ok": "#579"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img"><title>error / limit along the op sequence</title>']
    for v in range(int(lo), int(hi) + 1, 2):
        yy = y(10.0 ** v)
        parts.append(f'<line x1="{pad_l}" x2="{width - pad_r}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#eee"/>'
                     f'<text x="{pad_l - 6}" y="{yy + 4:.1f}" font-size="11" text-anchor="end">1e{v}</text>')
    y1 = y(1.0)
    parts.append(f'<line x1="{pad_l}" x2="{width - pad_r}" y1="{y1:.1f}" y2="{y1:.1f}" stroke="#c00" '
                 f'stroke-dasharray="4 3"/><text x="{width - pad_r - 4}" y="{y1 - 4:.1f}" font-size="11" '
                 f'text-anchor="end" fill="#c00">limit</text>')
    for r, i, e, status in points:
        c = colour.get(status, "#999")
        rad = 3.5 if status != "ok" else 1.8
        parts.append(f'<circle cx="{x(r, i):.1f}" cy="{y(e):.1f}" r="{rad}" fill="{c}"><title>'
                     f'{_esc(f"rank {r} op #{i} {status} error/limit {figure_text(e)}")}</title></circle>')
    parts.append(f'<text x="{(width + pad_l) / 2:.0f}" y="{height - 8}" font-size="12" text-anchor="middle">'
                 f'op number' + (" (ranks side by side: " + ", ".join(map(str, ranks)) + ")" if len(ranks) > 1
                                 else "") + "</text>")
    parts.append(f'<text x="14" y="{height / 2:.0f}" font-size="12" transform="rotate(-90 14 {height / 2:.0f})" '
                 f'text-anchor="middle">error / limit</text></svg>')
    return "".join(parts)


def render_html(h: HealthReport, out: TextIO) -> None:
    title = _title(h)
    if h.planted:  # the first line of every report says so
        out.write(f"<!-- {_esc(title[0])} -->\n")
    out.write(f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>"
              f"{_esc(title[-1])}</title><style>{_CSS}</style></head><body>\n")
    if h.planted:
        out.write(f'<p class="planted">{_esc(title[0])}</p>\n' + "".join(f"<p>{_esc(n)}</p>\n" for n in h.plant_notes))
    o = h.options
    out.write(f"<h1>{_esc(title[-1])}</h1><p>Replayed on {_esc(o.get('device'))} at {_esc(o.get('precision'))}: "
              + _esc(", ".join(f"{n} {s}" for s, n in h.counts.items())) + "</p>\n")
    for w in h.warnings:
        out.write(f"<p>warning: {_esc(w)}</p>\n")
    out.write("<h2>Checks</h2>" + _table(["check", "measured", "limit", "result"],
                                         [[c.what, c.measured, c.limit, _passed(c)] for c in h.checks],
                                         [_passed(c) for c in h.checks]))
    out.write("<h2>Error along the op sequence</h2>\n" + error_plot_svg(h.points) + "\n<h2>Culprit</h2>\n")
    if h.culprit is None:
        out.write("<p>No divergent or nondeterministic op.</p>\n")
    else:
        r = h.culprit
        out.write(f"<p>{_esc(h.culprit_kind)}: <b>#{r.index} {_esc(r.op)}</b>"
                  + (f" (rank {r.rank})" if r.rank else "") + "</p>"
                  + _table(["", ""], [[k, v] for k, v in _culprit_fields(r)]))
    out.write(f"<h2>The {TOP} ops with the largest error / limit</h2>" + _table(
        ["op", "name", "module", "phase", "status", "error / limit", "detail"],
        [[f"#{r.index}" + (f" r{r.rank}" if r.rank else ""), r.op, r.module or "", r.phase or "", r.status.value,
          figure_text(e), _detail(r)] for r, e in h.top]))
    out.write("<h2>Error per module</h2>" + _table(
        ["module", "ops", "divergent", "largest error / limit", "at"],
        [[m.module, str(m.ops), str(m.divergent), figure_text(m.worst),
          f"#{m.worst_op.index} {m.worst_op.op}" if m.worst_op else ""] for m in h.modules]))
    out.write("<h2>Likely causes</h2>\n")
    if not h.causes:
        out.write("<p>None with evidence in this trace and replay.</p>\n")
    for c in h.causes:
        out.write(f"<h3>{_esc(c.title)}</h3><p>Evidence:</p><ul>" + "".join(f"<li>{_esc(e)}</li>"
                                                                          for e in c.evidence)
                  + f"</ul><p>Remedy: {_esc(c.remedy)}</p>\n")
    out.write("<h2>Environment" + (f" (rank {h.environment_rank})" if h.environment_rank is not None else "")
              + "</h2>" + _table(["", ""], [[k, v] for k, v in _environment_rows(h.environment)]))
    out.write("</body></html>\n")
