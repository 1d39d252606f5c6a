"""One-line descriptions of an op's replay result: where it is, its figures against its limits, a number argument
NaN/Inf came in as, a planted fault. Every report (replay's summary, the health report's checks and evidence, diff)
words an op with these, so they say it the same way."""
from __future__ import annotations

import math

from replaydiff.compare.verdict import output_said
from replaydiff.rebuild_and_judge import shown
from replaydiff.replay.result import NonfiniteInput, OpResult
from replaydiff.trace.location import OpLocation


def op_line(r: OpResult) -> str:
    return f"#{r.index} {shown(r.op)}  {shown(place(r).where('no module'))}".rstrip()


def place(r: OpResult) -> OpLocation:
    """Where the op is (trace/location.py); from its own fields for a result read from an older report."""
    if r.location is not None:
        return r.location
    return OpLocation(module=r.module, phase=r.phase, source=r.source, source_text=None, of_forward=False,
                      backward_call=None, forward_index=r.forward_index, recompute=False, recompute_of=None)


def argument_text(held: NonfiniteInput) -> str:
    """'argument 2 (-inf)': the number argument NaN/Inf came in as (``NonfiniteInput.argument``)."""
    return f"argument {held.position} ({held.argument})" if held.position >= 0 else \
        f"a keyword argument ({held.argument})"


def planted_line(planted: list[str]) -> str:
    """The first line of every report on a trace with a planted fault: its culprit is there on purpose."""
    return "PLANTED FAULT (record --plant): " + shown("; ".join(planted))


def severity_text(r: OpResult) -> str:
    """``error / limit 2.05``: the op's severity (its verdict's, the one figure every report ranks and labels by),
    with what its limits are when they are not the dtype's fixed ones (an ill-conditioned op's own error)."""
    s = r.severity
    if s is None:
        return ""
    cal = r.verdict.calibration if r.verdict is not None else None
    own = f" (limits {cal.factor:g}x the op's own error at {cal.dtype})" if cal is not None and cal.limits else ""
    return f"error / limit {s:.3g}{own}"


def metrics_line(r: OpResult) -> str:
    """The op's severity first, then both figures it is the larger of, each against its fixed limit."""
    m = r.metrics or {}
    if "norm_max" in m:
        parts = [severity_text(r),
                 f"max_abs/(eps*absmax) {m['norm_max']:.3g} (limit {m.get('limit_max', float('nan')):.3g})",
                 f"rel_l2/eps {m['norm_rel']:.3g} (limit {m.get('limit_rel', float('nan')):.3g})",
                 f"rel_l2 {m['rel_l2']:.3g}", f"max_abs {m['max_abs']:.3g}"]
        if m.get("nonfinite_mismatch"):
            parts.append(f"{m['nonfinite_mismatch']} NaN/Inf mismatches")
        return output_said(m) + "  ".join(p for p in parts if p)
    if "mismatches" in m and output_said(m):
        return f"{output_said(m)}{m['mismatches']} elements differ" + (f"; {r.reason}" if r.reason else "")
    return r.reason or ""


def figure_text(x: float | None) -> str:
    """An error / limit as the health report writes it: 3 significant digits, 'inf', or '-' for none."""
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"
