"""Provides the detail pane's content for one op, as Textual markup text, and the element-wise error histogram.

Headless: it reads the trace and formats, it never imports textual. Links are ``@click`` markup that the app turns
into jumps (``app.goto(N)``), so a mouse user can walk the graph from the pane.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from replaydiff.compare.verdict import output_said
from replaydiff.rebuild_and_judge import shown
from replaydiff.diff.parallel import MappedOp
from replaydiff.replay.engine import trace_uses
from replaydiff.report.text import origin_how, record_again
from replaydiff.trace.modes import TensorMode
from replaydiff.trace.schema import LEFT_OUT_FILTERED, LEFT_OUT_WHY
from replaydiff.tui.diff_mode import unit_lead
from replaydiff.tui.model import PROBLEMS, RowResult, severity_text, short_op
from replaydiff.tui.styles import STATUS_MARKUP, pair_markup

MAX_MINMAX_NUMEL = 1 << 24  # min/max need the data: read tensors up to 16M elements for them
MAX_LINKS = 6


def esc(text: Any) -> str:
    """Text (a string from a trace) for Textual markup: its control characters and newlines ``shown`` as visible
    escapes, then markup escaped."""
    return shown(text).replace("\\", "\\\\").replace("[", "\\[")


def is_tensor_ref(x: Any) -> bool:
    return hasattr(x, "describe") and hasattr(x, "dtype") and hasattr(x, "shape")


def op_link(trace: Any, i: int | None, status: str | None = None, with_name: bool = True) -> str:
    if i is None:
        return "[dim]outside the trace[/]"
    name = ""
    if with_name:
        try:
            name = " " + esc(short_op(trace.index.name[i]))
        except (IndexError, KeyError):
            name = ""
    st = ""
    if status in PROBLEMS or status == "error":
        st = f" [{STATUS_MARKUP[status]}]{status}[/]"
    return f"[@click=app.goto({i})][underline]#{i}[/underline]{name}[/]{st}"


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def tensor_stats(trace: Any, ref: Any) -> str:
    """min max mean absmax NaN Inf for a recorded tensor: from its data when stored (min and max need it), else
    from the statistics the recorder kept."""
    st = getattr(ref, "stats", None)
    vals: dict[str, Any] = {}
    if st is not None:
        for k in ("mean", "absmax", "nan", "inf"):
            v = getattr(st, k, None)
            if v is not None:
                vals[k] = v
    if getattr(ref, "stored", False) and not getattr(ref, "uninitialised", False):
        try:
            numel = math.prod(ref.shape)
            if numel and numel <= MAX_MINMAX_NUMEL:
                import torch

                t = trace.tensor(ref)
                if t.is_floating_point() or t.is_complex():
                    t = t.abs() if t.is_complex() else t
                    d = t.double()
                    fin = torch.isfinite(d)
                    vals.setdefault("nan", int(torch.isnan(d).sum()))
                    vals.setdefault("inf", int(torch.isinf(d).sum()))
                    if bool(fin.any()):
                        f = d[fin]
                        vals["min"], vals["max"] = float(f.min()), float(f.max())
                        vals.setdefault("mean", float(f.mean()))
                        vals.setdefault("absmax", float(f.abs().max()))
                elif t.dtype != torch.bool:
                    vals["min"], vals["max"] = int(t.min()), int(t.max())
        except Exception:
            pass
    if not vals:
        return "[dim]no data or statistics recorded[/]"
    parts = []
    for k in ("min", "max", "mean", "absmax"):
        if k in vals:
            parts.append(f"{k} {_fmt(vals[k])}")
    for k, label in (("nan", "NaN"), ("inf", "Inf")):
        if k in vals:
            n = int(vals[k])
            parts.append(f"[bold red]{label} {n}[/]" if n else f"{label} 0")
    return "  ".join(parts)


def tensor_line(ref: Any) -> str:
    text = esc(ref.describe())
    stride = getattr(ref, "stride", None)
    if stride is not None:
        text += f"  [dim]stride {esc(tuple(stride))}[/]"
    dev = getattr(ref, "device", None)
    if dev and dev != "cpu":
        text += f"  [dim]{esc(dev)}[/]"
    if getattr(ref, "uninitialised", False):
        text += "  [dim]uninitialised[/]"
    elif not getattr(ref, "stored", True):
        text += "  [dim](data not stored)[/]"
    return text


def source_context(trace: Any, op: Any, around: int = 2) -> list[str]:
    """The op's source line as the trace recorded it, with a warning when the file here is no longer the one
    recorded. Only the trace's own text is shown: a file on this disk that the trace names is never displayed.
    (``around``: kept for callers; no lines of today's file are shown around it.)"""
    try:
        line = trace.source_line(op)
    except Exception:
        line = None
    if line is None:
        return []
    out = []
    warning = line.warning()
    if warning:
        out.append(f"[bold yellow]! {esc(shown(warning))}[/]")
    if line.recorded is not None:
        out.append(f"[bold]>{line.line:5d} │ {esc(shown(line.recorded))}[/]  [dim](as recorded)[/]")
    return out


def _output_line(m: dict) -> list[str]:
    """Which of the op's results the figures below judge, when it has several (``output 1 (mean) of 3``)."""
    said = output_said(m)
    return [f"  judged: [bold]{esc(said.rstrip(': '))}[/] of {m['output']['outputs']}"] if said else []


def verdict_lines(result: RowResult | None) -> list[str]:
    if result is None:
        return ["[dim]not replayed (yet)[/]"]
    if result.in_diff:
        return diff_lines(result)
    s = result.status
    head = f"[{STATUS_MARKUP.get(s, 'dim')}]{esc((s or '?').upper())}[/]"
    m = result.metrics or {}
    lines = [head]
    if "mismatches" in m:
        lines.extend(_output_line(m))
        lines.append(f"  exact comparison: {m['mismatches']} mismatched element(s)")
    elif "norm_max" in m:
        lines.append(severity_line(result.severity))
        lines.extend(_output_line(m))
        lines.append(f"  max_abs/(eps·absmax) [bold]{_fmt(m.get('norm_max'))}[/]  limit {_fmt(m.get('limit_max'))}")
        lines.append(f"  rel_l2/eps           [bold]{_fmt(m.get('norm_rel'))}[/]  limit {_fmt(m.get('limit_rel'))}")
        extra = [f"{k} {_fmt(m[k])}" for k in ("max_abs", "rel_l2", "cosine", "reduction_k", "nonfinite_mismatch")
                 if m.get(k) is not None and not (k in ("reduction_k", "nonfinite_mismatch") and m[k] in (0, 1))]
        if extra:
            lines.append("  " + "  ".join(extra))
    if result.reason:
        lines.append(f"  [dim]{esc(result.reason)}[/]")
    if result.nonfinite_origin:
        lines.append(f"  [bold red]NaN/Inf origin[/]: {origin_how(result.source)}")
    ended = getattr(result.source, "nonfinite_discarded_by", None)
    if ended is not None and getattr(result.source, "nonfinite_origin", False):
        at = ", ".join(f"#{i}" for i in ended[:3]) + (" ..." if len(ended) > 3 else "")
        lines.append(f"  [dim]NaN/Inf made and discarded: they end at {at} (finite output) and reach no loss, "
                     f"gradient, parameter or output[/]")
    return lines


def severity_line(severity: float | None) -> str:
    """The op's one figure, as the op list's err/lim column, the tree and replay's culprit line give it."""
    return f"  error / limit        [bold]{esc(severity_text(severity).rstrip('×') or '-')}[/]  [dim](the larger " \
           f"figure below over its limit; over 1 is divergent)[/]"


def unreplayable_lines(trace: Any, result: RowResult | None) -> list[str]:
    """The verdict of an op in a trace that holds no tensor data (record --tensors stats or meta), in place of
    verdict_lines: no op of it is ever replayed, so none is judged. Empty for a trace replay can run, and for a row
    with a verdict (diff mode compares statistics too)."""
    if result is not None:
        return []
    uses = trace_uses(trace)
    if "replay" in uses:
        return []
    mode = trace.options.tensors
    held = "per-tensor statistics (numel, mean, absmax, l2, var, NaN/Inf counts)" if mode is TensorMode.STATS \
        else "shapes and dtypes"
    other = "; t shows its trend" if "trend" in uses else ""
    return [f"[bold yellow]NOT REPLAYABLE[/]  recorded with --tensors {esc(mode)}: {held}, no tensor data, so no op "
            f"of this trace is ever replayed or judged",
            f"  record with --tensors full (the default) to judge each op; or compare two runs: replaydiff tui "
            f"TRACE --diff REF{other}"]


def left_out_lines(op: Any, result: RowResult | None) -> list[str]:
    """The verdict of an op whose tensor data the recording left out (``OpRecord.data_left_out``), in place of
    verdict_lines: replay does not judge it, replayed or not. Past the budget or after a full disk is a gap, so never
    clean; outside the --module/--op filter is the user's choice. Empty for any other op, and in diff mode (a diff
    compares statistics too)."""
    why = getattr(op, "data_left_out", None)
    if why is None or (result is not None and result.in_diff):
        return []
    if why == LEFT_OUT_FILTERED:
        return [f"[dim]NOT JUDGED[/]  tensor data left out: {esc(LEFT_OUT_WHY[why])}",
                "  [dim]statistics only (below); replay judges the ops the filter kept[/]"]
    return [f"[bold yellow]NOT JUDGED[/]  tensor data left out: {esc(LEFT_OUT_WHY.get(why, why))}",
            f"  statistics only (below), so replay cannot judge this op and a replay of this trace is never clean; "
            f"{esc(record_again({why}))}"]


def mapped_lines(result: RowResult, op: MappedOp) -> list[str]:
    """Diff mode of a parallel run against one process: the reference op every rank's op maps onto, each tensor's
    layout, and why it parts (the departure) or that it reads what did."""
    s = result.status
    word = {"ok": "MAPS", "divergent": "PARTS HERE", "inherited": "INHERITED"}.get(str(s), str(s).upper())
    ref = f"ref #{op.ref}" if op.ref_rank is None else f"ref rank {op.ref_rank} #{op.ref}"
    lines = [f"[{STATUS_MARKUP.get(s, 'dim')}]{word}[/]  mapped onto reference op [bold]{ref}[/] with every "
             f"rank's op ({', '.join(f'rank {r} #{i}' for r, i in op.on_ranks())})"]
    for t in op.tensors:
        what = t.layout.describe() if t.layout is not None else "no layout fits"
        if t.declared is not None:
            what += f" ({'from DTensor placements' if t.layout_from == 'placements' else 'inferred'}: " \
                    f"{t.declared.describe()})"
        lines.append(f"  {'input' if t.kind == 'in' else 'output'} {t.position} {esc(t.describe)}: {esc(what)}")
    if result.reason and s != "ok":
        lines.append(f"  [dim]{esc(result.reason)}[/]")
    return lines


def diff_lines(result: RowResult) -> list[str]:
    """Diff mode: the aligned reference op and the pair's verdict, evidence, reason and inherited origin."""
    s = result.status
    if result.unit is not None:
        return unit_pair_markup(result)
    if isinstance(result.source, MappedOp):
        return mapped_lines(result, result.source)
    pair = result.pair
    if pair is None:
        return [f"[cyan]TARGET ONLY[/]  no aligned op in the reference (rank {result.ref_rank})"]
    style = pair_markup(pair.status, s)
    lines = [f"[{style}]{esc(str(pair.status).upper())}[/]  aligned with reference op "
             f"[bold]ref #{pair.ref}[/] (rank {result.ref_rank})"
             + (f"  [dim]reference op {esc(pair.target_op)}[/]" if pair.target_op else "")]
    if pair.evidence is not None:
        agree = {True: "agree", False: "differ", None: "not compared"}[pair.inputs_agree]
        lines.append(f"  evidence: {esc(pair.evidence)}; inputs {agree}")
    if pair.dtypes is not None:
        lines.append(f"  output dtypes differ: ref {esc(pair.dtypes[0])}, target {esc(pair.dtypes[1])}")
    m = pair.metrics or {}
    if "mismatches" in m:
        lines.extend(_output_line(m))
        lines.append(f"  exact comparison: {m['mismatches']} mismatched element(s)")
    elif "norm_max" in m:
        lines.append(severity_line(pair.severity))
        lines.extend(_output_line(m))
        lines.append(f"  max_abs/(eps·absmax) [bold]{_fmt(m.get('norm_max'))}[/]  limit {_fmt(m.get('limit_max'))}")
        lines.append(f"  rel_l2/eps           [bold]{_fmt(m.get('norm_rel'))}[/]  limit {_fmt(m.get('limit_rel'))}")
    if pair.reason:
        lines.append(f"  [dim]{esc(pair.reason)}[/]")
    origin = pair.inherited_from
    if origin is not None:
        link = ""
        if getattr(origin, "target", None) is not None:
            link = f"  [@click=app.goto({origin.target})][underline]go to #{origin.target}[/underline][/]"
        lines.append(f"  inherited from {esc(origin.describe())}{link}")
    return lines


def unit_pair_markup(result: RowResult) -> list[str]:
    """Diff mode, a row a compiled unit pair covers: the pair as ``replaydiff diff`` prints it, with a link to the
    target's op where they part when that is an eager op of the target."""
    from replaydiff.report.diff_text import unit_pair_lines

    u = result.unit
    style = pair_markup(u.status, str(u.status))
    own = u.side == "target" and result.index == u.unit
    what = ("this compiled unit against the reference's eager ops of its region" if own else
            f"compared as part of compiled unit ref #{u.unit} ({esc(u.op)}), against this trace's eager ops of its "
            f"region" if u.side == "ref" else f"part of compiled unit target #{u.unit}")
    lines = [f"[{style}]{esc(str(u.status).upper())}[/]  {what} (rank {result.ref_rank})"]
    lines.extend("  " + esc(line) for line in unit_pair_lines(u))
    lead = unit_lead(u)
    if u.side == "ref" and lead is not None and lead != result.index:
        where = "where they part" if u.part is not None else "which carries the unit's verdict"
        lines.append(f"  [@click=app.goto({lead})][underline]go to #{lead}[/underline][/] {where}")
    return lines


def _walk(value: Any, out: list[Any]) -> None:
    if is_tensor_ref(value):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _walk(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _walk(v, out)


def _value_text(value: Any, positions: dict[int, int], producers: dict, trace: Any,
                statuses: list, seen: list[int]) -> tuple[str, list[str]]:
    """One argument: its text, and one line per tensor it holds (with the op that produced it). Input positions
    count tensors in argument order (args, then kwargs, flattened), as ``OpRecord.inputs()`` does; ``seen`` carries
    the count from one argument to the next."""
    refs: list[Any] = []
    _walk(value, refs)
    if not refs:
        text = repr(value)
        return esc(text if len(text) < 60 else text[:57] + "..."), []
    lines = []
    for ref in refs:
        k = positions.get(id(ref), seen[0] if seen[0] < len(positions) else None)
        seen[0] += 1
        prod = producers.get(k) if k is not None else None
        st = statuses[prod] if prod is not None and 0 <= prod < len(statuses) else None
        origin = f"  ← {op_link(trace, prod, st)}" if k is not None else ""
        lines.append(f"in{k if k is not None else '?'} {tensor_line(ref)}{origin}")
    return "", lines


UNIT_NODES_SHOWN = 200


def unit_lines(op: Any) -> list[str]:
    """A compiled unit expanded: its region and backend, the backend's kernels, and its graph's nodes."""
    unit = getattr(op, "unit", None)
    if unit is None:
        return []
    calls = unit.calls()
    out = [f"[b]compiled unit[/]  {esc(unit.kind or '')} graph {esc(unit.graph_id or '?')} of "
           f"{esc(unit.region or '?')}, {esc(unit.backend or '?')}: {len(calls)} nodes, {len(unit.kernels)} kernels"]
    if unit.note:
        out.append(f"  [dim]{esc(unit.note)}[/]")
    if unit.kernels:
        out.append("  kernels " + esc(", ".join(unit.kernels)))
    for n in calls[:UNIT_NODES_SHOWN]:
        out.append(f"  {esc(node_text(n))}" + (f"  [dim]{esc(n.module)}[/]" if n.module else ""))
    if len(calls) > UNIT_NODES_SHOWN:
        out.append(f"  [dim]... {len(calls) - UNIT_NODES_SHOWN} more nodes (replaydiff show --op {op.index})[/]")
    return out


def node_text(n: Any) -> str:
    """A unit's call node as the detail pane and the op list show it: ``gelu = aten.gelu.default``."""
    return f"{n.name} = {n.target}"


def unit_rows(op: Any) -> list[str]:
    """A compiled unit expanded in the op list, as plain text lines: its kernels, then its call nodes with their
    modules (all of them: the list draws only the rows on screen). Empty for an op that is not a unit."""
    unit = getattr(op, "unit", None)
    if unit is None:
        return []
    out = [f"kernels {', '.join(unit.kernels)}"] if unit.kernels else []
    if unit.note:
        out.append(unit.note)
    out.extend(node_text(n) + (f"  {n.module}" if n.module else "") for n in unit.calls())
    return out


def op_markup(trace: Any, i: int, result: RowResult | None, statuses: list) -> str:
    """The whole detail pane for op ``i`` as Textual markup."""
    op = trace[i]
    out: list[str] = []
    phase = op.phase or ""
    out.append(f"[bold]#{i} {esc(op.name)}[/]  {esc(phase)}  [cyan]{esc(op.module or '')}[/]")
    if not getattr(op, "recorded", True):
        out.append("[dim]no record for this op number[/]")
        return "\n".join(out)
    if op.schema:
        out.append(f"[dim]{esc(op.schema)}[/]")
    out.extend(unit_lines(op))
    if op.forward_index is not None:
        out.append(f"backward of forward op {op_link(trace, op.forward_index, statuses[op.forward_index])}  [dim](b)[/]")
    elif getattr(op, "recompute_of", None) is not None:
        out.append(f"recompute of forward op {op_link(trace, op.recompute_of, statuses[op.recompute_of])}")
    out.append("")
    out.append("[b]verdict[/]  " + "\n".join(left_out_lines(op, result) or unreplayable_lines(trace, result)
                                             or verdict_lines(result)))
    # where the op is, as every report says it (trace/location.py): a backward op's code is its forward op's
    try:
        loc = trace.location(op, text=True)
    except Exception:
        loc = None
    if loc is not None and loc.source:
        source_op = op
        if loc.of_forward:
            try:
                source_op = trace[op.forward_index]
            except Exception:
                pass
        out.append("")
        out.append(f"[b]source[/]  {esc(loc.source)}" + (" [dim](of the forward op)[/]" if loc.of_forward else ""))
        out.extend(source_context(trace, source_op))
        if loc.backward_call:
            out.append(f"  [dim]backward() called at {esc(loc.backward_call)}[/]")
    # arguments
    inputs = op.inputs()
    positions = {id(r): k for k, r in enumerate(inputs)}
    try:
        producers = trace.producers(i)
    except Exception:
        producers = {}
    out.append("")
    out.append("[b]arguments[/]")
    arg_items = [(str(k), v) for k, v in enumerate(op.args)] + [(k, v) for k, v in op.kwargs.items()]
    seen = [0]
    for label, value in arg_items:
        text, lines = _value_text(value, positions, producers, trace, statuses, seen)
        if lines:
            out.append(f"  {esc(label)}: " + lines[0])
            out.extend("     " + ln for ln in lines[1:])
        else:
            out.append(f"  {esc(label)}: {text}")
    if not arg_items:
        out.append("  [dim](none)[/]")
    # outputs
    outs = op.outputs_refs()
    try:
        consumers = trace.consumers(i)
    except Exception:
        consumers = {}
    out.append("")
    out.append("[b]outputs[/]")
    for k, ref in enumerate(outs):
        users = consumers.get(k) or []
        links = ", ".join(op_link(trace, u, statuses[u] if 0 <= u < len(statuses) else None) for u in users[:MAX_LINKS])
        more = f" [dim]+{len(users) - MAX_LINKS} more (c)[/]" if len(users) > MAX_LINKS else ""
        out.append(f"  out{k} {tensor_line(ref)}")
        out.append(f"       {tensor_stats(trace, ref)}")
        out.append(f"       → {links}{more}" if users else "       → [dim]not read again in this trace[/]")
    if not outs:
        out.append("  [dim](no tensor outputs)[/]")
    return "\n".join(out)


# -- element-wise error histogram ---------------------------------------------------------------------------------
BUCKETS = ("0", "<1", "1-10", "10-100", "1e2-1e3", "1e3-1e4", "1e4-1e5", "≥1e5")


def reference_pairs(trace: Any, i: int, options: Any) -> list[tuple[Any, Any]] | None:
    """(recorded tensor, reference tensor) pairs for op ``i``'s outputs, by replaying that op alone; None when
    replaydiff has no single-op replay to call."""
    import torch
    from replaydiff import replay

    replay_op: Callable | None = getattr(replay, "replay_op", None)
    if replay_op is None:
        return None
    _, pairs = replay_op(trace, trace[i], options)
    out = []
    for recorded, reference in pairs:
        if not isinstance(reference, torch.Tensor):
            continue  # a scalar output: nothing to spread over elements
        if is_tensor_ref(recorded):
            if not recorded.stored:
                continue
            recorded = trace.tensor(recorded)
        if isinstance(recorded, torch.Tensor):
            out.append((recorded, reference))
    return out


def error_histogram(pairs: list[tuple[Any, Any]]) -> tuple[list[tuple[str, int]], int]:
    """Counts of element-wise |recorded - reference| / (eps * max|reference|) by decade, and how many elements
    are NaN/Inf in one but not the other."""
    import torch

    counts = [0] * len(BUCKETS)
    nonfinite = 0
    for rec, ref in pairs:
        if rec is None or ref is None or rec.numel() == 0:
            continue
        dt = rec.dtype
        eps = torch.finfo(dt).eps if (dt.is_floating_point or dt.is_complex) else 1.0
        a, b = rec.detach().to(torch.complex128 if rec.is_complex() else torch.float64).flatten(), \
            ref.detach().to(torch.complex128 if ref.is_complex() else torch.float64).flatten()
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        nonfinite += int((fa != fb).sum())
        both = fa & fb
        if not bool(both.any()):
            continue
        diff = (a[both] - b[both]).abs()
        scale = eps * float(b[both].abs().max())
        e = diff / scale if scale > 0 else torch.where(diff > 0, torch.full_like(diff, math.inf), diff)
        counts[0] += int((e == 0).sum())
        edges = [0.0, 1.0, 10.0, 1e2, 1e3, 1e4, 1e5, math.inf]
        for k in range(1, len(BUCKETS)):
            lo, hi = edges[k - 1], edges[k]
            sel = (e > lo) & (e < hi) if k == 1 else (e >= lo) & (e < hi)
            if k == len(BUCKETS) - 1:
                sel = e >= lo
            counts[k] += int(sel.sum())
    return list(zip(BUCKETS, counts)), nonfinite


def histogram_markup(hist: list[tuple[str, int]], nonfinite: int, width: int = 30) -> str:
    top = max((n for _, n in hist), default=0) or 1
    lines = ["[b]element-wise error[/] [dim](|recorded - reference| / (eps·absmax), elements)[/]"]
    for label, n in hist:
        bar = "█" * (math.ceil(n / top * width) if n else 0)
        lines.append(f"  {label:>8} [red]{bar}[/] {n}")
    if nonfinite:
        lines.append(f"  [bold red]{nonfinite} NaN/Inf mismatch(es)[/]")
    return "\n".join(lines)


def is_problem(result: RowResult | None) -> bool:
    return result is not None and result.status in PROBLEMS
