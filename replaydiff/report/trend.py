"""Rendering a trend (``replaydiff.trend.TrendResult``): the text report, its JSON (``replaydiff.trend/1``) and an SVG
plot. Each reads the result and nothing else: the series, the change, its cause and the zoom-in were computed by
``replaydiff.trend``."""
from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from typing import TextIO

from replaydiff.rebuild_and_judge import shown
from replaydiff.replay.result import nonfinite_counts
from replaydiff.trend import (MIN_HISTORY, STATISTICS, Cause, Change, LateWindow, Series, TrendResult, Unscored,
                              Zoom, log10_of, sound_score)

FORMAT = "replaydiff.trend/1"


# -- JSON -----------------------------------------------------------------------------------------------------------
def to_json(t: TrendResult, trace: str = "TRACE") -> dict:
    """The ``replaydiff.trend/1`` document; ``trace``: the trace as the user named it, for the next commands."""
    z = t.zoom
    return {"format": FORMAT, "rank": t.rank, "steps": t.steps, "window": t.window,
            "threshold": t.threshold, "module": t.module_glob, "ops": t.ops_read,
            "first_change": None if t.first_change is None else _change_json(t.first_change),
            "passed_over": None if t.passed_over is None else _change_json(t.passed_over),
            "not_scored": None if t.unscored is None else _unscored_json(t.unscored),
            "cause": None if t.cause is None else _cause_json(t.cause),
            "nonfinite_discarded": None if t.discarded is None else _change_json(t.discarded),
            "zoom": None if z is None else _zoom_json(z, trace),
            "next": None if z is None else z.commands(trace, t.command, t.command_dir),
            "late_window": None if t.late_window is None else _late_json(t.late_window),
            "series": [_series_json(s) for s in t.series]}


def _change_json(c: Change) -> dict:
    return {"step": c.step, "module": c.module, "op": c.op, "index": c.index, "phase": c.phase,
            "parameter": c.parameter, "statistic": c.statistic, "score": c.score, "value": c.value,
            "baseline": c.baseline, "history": c.history, "weak": not c.sound}


def _unscored_json(u: Unscored) -> dict:
    return {"records": u.records, "modules": list(u.modules),
            "filter": {"modules": None if u.filter_modules is None else list(u.filter_modules),
                       "ops": None if u.filter_ops is None else list(u.filter_ops)}}


def _finite_or_none(v: float | None) -> float | None:
    return v if v is None or math.isfinite(v) else None


def _series_json(s: Series) -> dict:
    return {"module": s.module, "kind": s.kind, "steps": s.steps,
            **{k: [_finite_or_none(v) for v in s.values[k]] for k in STATISTICS}}


def _cause_json(c: Cause) -> dict:
    return {"step": c.step, "index": c.index, "op": c.op, "module": c.module, "phase": c.phase,
            "source": c.source, "source_text": c.source_text, "how": c.how, "statistic": c.statistic,
            "value": c.value, "baseline": c.baseline, "history": c.history, "position": c.position,
            "producer": c.producer, "from_finite": c.from_finite,
            "changed_args": list(c.changed_args), "args_since": c.args_since}


def _zoom_json(z: Zoom, trace: str) -> dict:
    return {"tensors": "full", "steps": z.steps, "modules": z.modules, "ops": z.ops, "out": z.out(trace)}


def _late_json(w: LateWindow) -> dict:
    return {"step": w.step, "first_step": w.first, "last_step": w.last, "flight": w.keep,
            "steps_before": w.before, "flight_mib": w.mib}


# -- text -----------------------------------------------------------------------------------------------------------
def describe_late_window(w: LateWindow) -> str:
    """One line: the flight window may have begun after the change, and the flags that keep the steps before it."""
    was = f" (it was {w.was})" if w.was else ""
    flags = f"--flight {w.keep}{was}"
    if w.mib is not None:
        flags += f" --flight-mib {w.mib} ({w.dropped} older step(s) were dropped to stay within " \
                 f"{w.was_mib:g} MiB)"
    if w.step == w.first:
        where = "its first step, so nothing before it was compared"
    elif w.nonfinite:
        where = "the earliest step where trend can see NaN/Inf appear (against the step before)"
    else:
        where = f"the earliest step where trend can see a jump (it compares a step with the {MIN_HISTORY} or " \
                f"more before it)"
    return f"the flight window ({w.first}..{w.last}) may have begun too late: the change is at step " \
           f"{w.step}, {where}; record again with {flags} to keep the {w.before} " \
           f"step{'' if w.before == 1 else 's'} before step {w.first} as well"


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float | None], held: list[float | None] | None = None) -> str:
    """log10-scaled bars; a space where a step has no value, ``!`` where the tensor held NaN/Inf (``held``: their
    count per step): its l2 is that of the finite values only (0 when there are none), so it is no bar and no part
    of the scale."""
    marks = [bool(h) for h in held] if held is not None else [False] * len(values)
    logs = [None if v is None or bad else log10_of(v) for v, bad in zip(values, marks)]
    real = [x for x in logs if x is not None]
    lo, hi = (min(real), max(real)) if real else (0.0, 0.0)
    span = hi - lo or 1.0
    return "".join("!" if bad else " " if x is None else _BARS[min(7, int((x - lo) / span * 7.999))]
                   for x, bad in zip(logs, marks))


@dataclass(frozen=True)
class SeriesSummary:
    """What a table row shows of one series (the text report and the TUI's trend screen)."""

    first_l2: float | None
    last_l2: float | None
    absmax_max: float | None
    nonfinite: int  # NaN and Inf values over all steps
    # The NaN/Inf the tensor held at the step of first_l2 / last_l2 ("16 NaN", "" for none): the l2 of a tensor of
    # NaN is that of its finite values, 0 when it has none, which is no zero tensor.
    first_held: str = ""
    last_held: str = ""


def nonfinite_per_step(s: Series) -> list[float | None]:
    """NaN and Inf values of the series' tensor at each step (None where the step has no such op)."""
    return [None if n is None and i is None else (n or 0) + (i or 0)
            for n, i in zip(s.values["nan"], s.values["inf"])]


def _held(s: Series, k: int) -> str:
    """'16 NaN', '1 NaN and 2 Inf': what the series' tensor held at step position ``k`` ('' for none)."""
    return nonfinite_counts(int(s.values["nan"][k] or 0), int(s.values["inf"][k] or 0))


def summarise(s: Series) -> SeriesSummary:
    l2 = s.values["l2"]
    at = [k for k, v in enumerate(l2) if v is not None]
    return SeriesSummary(first_l2=l2[at[0]] if at else None, last_l2=l2[at[-1]] if at else None,
                         absmax_max=max((v for v in s.values["absmax"] if v is not None), default=None),
                         nonfinite=sum(int(v or 0) for k in ("nan", "inf") for v in s.values[k]),
                         first_held=_held(s, at[0]) if at else "", last_held=_held(s, at[-1]) if at else "")


def describe_change(c: Change, threshold: float | None = None) -> str:
    """One line: where the change is (step, module, op) and what changed; for a weak jump (scored against too few
    steps, ``threshold``: the trend's) the score it would need."""
    weak = f" against only {c.history} steps, where {sound_score(threshold, c.history):.3g} is needed: weak evidence" \
        if not c.sound and threshold is not None and c.history is not None else ""
    what = (f"{c.statistic} {c.value:.4g} after a median of {c.baseline:.4g} (z = {c.score:g}{weak})"
            if c.statistic in ("l2", "absmax") else f"{int(c.value)} {c.statistic.upper()} value(s) appeared")
    param = f" {c.parameter}" if c.parameter else ""
    return f"step {c.step}, module {shown(c.module or '-')}, op #{c.index} {shown(c.op)}{param} ({shown(c.phase)}): " \
           f"{what}"


def describe_unscored(u: Unscored, trace: str = "TRACE") -> str:
    """One line: which records trend could not score (tensor data without statistics) and what that hides."""
    flags = " ".join([f"--module {shlex.quote(m)}" for m in u.filter_modules or ()] +
                     [f"--op {shlex.quote(o)}" for o in u.filter_ops or ()])
    which = f"the ops of {flags}" if flags else "the ops recorded in full"
    names = ", ".join(shown(m) for m in u.modules[:4]) + (f" and {len(u.modules) - 4} more" if len(u.modules) > 4
                                                         else "")
    return f"not scored: {shown(which)} ({u.records} record{'' if u.records == 1 else 's'}, in {names}) hold tensor " \
           f"data without statistics, which trend cannot score: a change made there is not seen, and is named, if " \
           f"at all, where it shows outside them (replay judges those ops: replaydiff replay {shlex.quote(trace)})"


def describe_no_change(t: TrendResult) -> str:
    """One line: nothing changed, and what would have counted."""
    return f"no sudden change (robust z-score >= {t.threshold:g} against up to {t.window} steps before, " \
           f"{MIN_HISTORY} at least; a gradient must fall 10x under its lowest value before or rise 2x over its highest)"


def describe_passed_over(t: TrendResult) -> str:
    """One line: the earlier jump, weak evidence, that a sounder change after it outranked."""
    w = t.passed_over
    assert w is not None
    return f"an earlier jump, passed over for the sounder change after it: {describe_change(w, t.threshold)}"


def describe_cause(c: Cause) -> str:
    """One line: the op that made the change (or through whose input it entered), where in the code, and why."""
    where = shown(", ".join(x for x in (c.module or "no module", c.phase) if x))
    at = f" at {shown(c.source)}" + (f" ({shown(c.source_text.strip())})" if c.source_text else "") \
        if c.source else ""
    if c.statistic in ("l2", "absmax"):
        what = f"{c.statistic} {c.value:.4g} against {c.baseline:.4g} before"
    else:
        what = f"{int(c.value)} {c.statistic.upper()} value(s) where there were none"
    if c.how == "entered":
        whence = "from outside the trace (written where the recorder did not see it: between recorded steps, " \
                 "before the step's first recorded op, or as a tensor made from a Python number)" \
            if c.producer is None else \
            f"from op #{c.producer}, which the record filter left out"
        return f"op #{c.index} {shown(c.op)} ({where}){at}, step {c.step}: the change enters through its input " \
               f"{c.position}, {what}, {whence}"
    if c.from_finite:
        new = "; it runs in no earlier recorded step" if c.history == 0 else ""
        return f"op #{c.index} {shown(c.op)} ({where}){at}, step {c.step}: made {int(c.value)} {c.statistic.upper()} " \
               f"value(s) from inputs that had none{new}"
    if c.phase == "optimizer" and c.how == "made":
        args = f"; its arguments differ from earlier steps: {', '.join(c.changed_args)} (a learning rate or other " \
               f"hyperparameter changed)" if c.changed_args else "; its arguments are those of earlier steps"
        return f"op #{c.index} {shown(c.op)} ({where}){at}, step {c.step}: the optimizer's update made the change, " \
               f"{what}{args}"
    if c.changed_args:
        what += f"; its arguments differ from earlier steps: {', '.join(c.changed_args)}"
    alone = "; it runs in no earlier recorded step, so it was scored against the earlier statistics of the tensor " \
            "it wrote" if c.history == 0 else ""
    return f"op #{c.index} {shown(c.op)} ({where}){at}, step {c.step}: made the change, {what}{alone}"


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _fmt_held(v: float | None, held: str) -> str:
    """An l2 of a tensor that held NaN/Inf (``held``: '16 NaN'): that of its finite values, with the count; '-'
    for none of them (0: there were no finite values, which is no zero tensor)."""
    return _fmt(v) if not held else f"{_fmt(v or None)} ({held})"


def render_text(t: TrendResult, out: TextIO, width: int = 60, trace: str = "TRACE") -> None:
    """The text report; ``trace``: the trace as the user named it, for the next commands."""
    steps = f"{len(t.steps)} step{'' if len(t.steps) == 1 else 's'}"
    out.write(f"rank {t.rank}: {steps} ({t.steps[0]}..{t.steps[-1]}), {t.ops_read} records"
              f"{'' if t.module_glob is None else f', modules {t.module_glob}'}\n")
    if t.unscored is not None:
        out.write(describe_unscored(t.unscored, trace) + "\n")
    c = t.first_change
    if c is None and len(t.steps) < 2:  # nothing to compare a step with
        out.write(f"nothing judged: trend compares each step with the steps before it, and this trace holds "
                  f"{len(t.steps)} step; NaN/Inf appearing needs 2 steps, a jump in a statistic {MIN_HISTORY + 1} "
                  f"({MIN_HISTORY} before it; {t.window} fill the window): record more with --steps or --flight\n")
    elif c is None and len(t.steps) <= MIN_HISTORY:
        out.write(f"no NaN/Inf appeared; a jump in a statistic was not judged: it needs {MIN_HISTORY + 1} steps "
                  f"({MIN_HISTORY} before it; {t.window} fill the window), and this trace holds {len(t.steps)}: "
                  f"record more with --steps or --flight\n")
    elif c is None:
        out.write(describe_no_change(t) + "\n")
    else:
        out.write(f"first change: {describe_change(c, t.threshold)}\n")
        if t.cause_to_tell is not None:
            out.write(f"cause: {describe_cause(t.cause_to_tell)}\n")
        if t.passed_over is not None:
            out.write(describe_passed_over(t) + "\n")
        if t.late_window is not None:
            out.write(describe_late_window(t.late_window) + "\n")
    d = t.discarded
    if d is not None:
        out.write(f"NaN/Inf made and discarded (not a change): {describe_change(d)}, and no op keeps them: they reach "
                  f"no loss, gradient, parameter or output\n")
    steps = t.steps
    if len(steps) > width:  # the last `width` steps in the sparklines
        out.write(f"sparklines: log10 l2 of the last {width} steps\n")
    for line in table_lines(t, width):
        out.write(line + "\n")
    lines = next_lines(t, trace)
    if lines:
        out.write("\n" + "".join(line + "\n" for line in lines))


def next_lines(t: TrendResult, trace: str = "TRACE") -> list[str]:
    """What to run next, as lines (none without a change): record its steps in full, then replay them. The text
    report and the TUI's trend screen both show them."""
    z = t.zoom
    if z is None:
        return []
    cmd = z.commands(trace, t.command, t.command_dir)
    lines = [f"Next: record steps {z.steps} in full around the change, then replay them (replay says whether an op "
             f"there computes wrongly, else through which input or optimizer argument a change of 4x or more from "
             f"one step to the next enters):"]
    if cmd["record"] is not None:
        return lines + [f"  {cmd['record']}", f"  {cmd['replay']}"]
    return lines + [f"  {z.record_options(trace)}", f"  {cmd['replay']}",
                    f"(after the record command's `--`, type the command that runs your training: {trace} holds none, "
                    f"as it was recorded from Python (or by an older replaydiff); or record from Python: "
                    f"{cmd['python']})"]


def table_lines(t: TrendResult, width: int) -> list[str]:
    """The per-series table, header first, columns aligned; the first change's module marked with '*' (the text
    report and the terminal UI's trend screen both show it)."""
    c = t.first_change
    rows = []
    for s in t.series:
        m = summarise(s)
        mark = "*" if c is not None and c.module == s.module else " "
        rows.append((mark + shown(s.module), shown(s.kind), _fmt_held(m.first_l2, m.first_held),
                     _fmt_held(m.last_l2, m.last_held), _fmt(m.absmax_max if m.absmax_max or not m.nonfinite else None),
                     str(m.nonfinite), sparkline(s.values["l2"][-width:], nonfinite_per_step(s)[-width:])))
    headers = (" module", "kind", "l2 first", "l2 last", "absmax max", "nan+inf", "l2 by step (log)")
    widths = [max(len(h), *(len(r[k]) for r in rows)) if rows else len(h) for k, h in enumerate(headers)]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in (headers, *rows)]


# -- SVG --------------------------------------------------------------------------------------------------------------
def render_svg(t: TrendResult, out: TextIO, kind: str = "output", max_series: int = 40) -> None:
    """log10 l2 of each module's ``kind`` series against the step, the first change marked; plain SVG text."""
    from xml.sax.saxutils import escape

    W, H, L, R, T, B = 960, 540, 60, 300, 30, 40
    series = [s for s in t.series if s.kind == kind][:max_series]
    pts = [(st, log10_of(v)) for s in series for st, v in zip(s.steps, s.values["l2"]) if v is not None]
    out.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="monospace" '
              f'font-size="11">\n<rect width="{W}" height="{H}" fill="white"/>\n')
    title = f"replaydiff trend: log10 l2 of module {kind}s, rank {t.rank}"
    out.write(f'<text x="{L}" y="18" font-size="13">{escape(title)}</text>\n')
    if not pts:
        out.write(f'<text x="{L}" y="{H // 2}">no values</text>\n</svg>\n')
        return
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def X(st: float) -> float:
        return L + (st - x0) / (x1 - x0) * (W - L - R)

    def Y(v: float) -> float:
        return H - B - (v - y0) / (y1 - y0) * (H - T - B)

    out.write(f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>\n'
              f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>\n'
              f'<text x="{L}" y="{H - 12}">step {x0}</text><text x="{W - R}" y="{H - 12}" text-anchor="end">'
              f'step {x1}</text>\n<text x="4" y="{T + 10}">{y1:.1f}</text><text x="4" y="{H - B}">{y0:.1f}</text>\n')
    c = t.first_change
    if c is not None:
        out.write(f'<line x1="{X(c.step):.1f}" y1="{T}" x2="{X(c.step):.1f}" y2="{H - B}" stroke="red" '
                  f'stroke-dasharray="4 3"/>\n<text x="{X(c.step) + 4:.1f}" y="{T + 12}" fill="red">'
                  f'{escape(shown(f"step {c.step}: {c.module} {c.op}"))}</text>\n')
    for k, s in enumerate(series):
        colour = f"hsl({(k * 137) % 360},65%,42%)"
        hot = c is not None and c.module == s.module
        path = " ".join(f"{X(st):.1f},{Y(log10_of(v)):.1f}" for st, v in zip(s.steps, s.values["l2"]) if v is not None)
        out.write(f'<polyline fill="none" stroke="{colour}" stroke-width="{2.5 if hot else 1}" points="{path}">'
                  f'<title>{escape(shown(s.module))}</title></polyline>\n')
        out.write(f'<text x="{W - R + 8}" y="{T + 12 * k + 10}" fill="{colour}">{escape(shown(s.module)[-45:])}</text>\n')
    out.write("</svg>\n")
