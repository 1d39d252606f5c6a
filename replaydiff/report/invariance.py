"""Rendering a batch-invariance check (``replaydiff.invariance.InvarianceResult``): the text report and its JSON
(``replaydiff.invariance/1``). Each reads the result and nothing else."""
from __future__ import annotations

import math
import textwrap
from typing import TextIO

from replaydiff.rebuild_and_judge import shown
from replaydiff.invariance import Finding, InvarianceResult, OpCheck, SliceDiff
from replaydiff.invariance.rows import RowsDiff, RowsPart

FORMAT = "replaydiff.invariance/1"
SHOWN = 12  # batch-variant ops listed one by one in the text (all of them in the JSON)


# -- JSON -----------------------------------------------------------------------------------------------------------
def to_json(r: InvarianceResult, trace: str = "TRACE") -> dict:
    return {"format": FORMAT, "trace": trace, "rank": r.rank, "batch_size": r.batch_size,
            "batch_input": r.batch_input, "slices": [[s.start, s.stop] for s in r.rows], "device": r.device,
            "threads": r.threads, "counts": {f.value: r.count(f) for f in Finding},
            "kinds": [{"op": k.op, "invariant": k.invariant, "variant": k.variant,
                       "kind": k.advice.kind if k.advice else None, "advice": k.advice.remedy if k.advice else None,
                       "first": [{"index": c.index, "source": c.source} for c in k.first]} for k in r.kinds],
            "ops": [_check_json(c) for c in r.checks]}


def _number(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _check_json(c: OpCheck) -> dict:
    d: dict = {"index": c.index, "op": c.op, "module": c.module, "phase": c.phase, "source": c.source,
               "finding": c.finding.value}
    if c.reason:
        d["reason"] = c.reason
    if c.diffs:
        d["diffs"] = [{"rows": [s.rows.start, s.rows.stop], "output": s.output, "mismatches": s.mismatches,
                       "elements": s.elements, "max_ulps": s.max_ulps, "rel_l2": _number(s.rel_l2),
                       "max_abs": _number(s.max_abs)} for s in c.diffs]
        d["reaches"] = [{"index": o.index, "op": o.op, "module": o.module} for o in c.reaches]
    return d


# -- text -----------------------------------------------------------------------------------------------------------
def _where(c: OpCheck) -> str:
    parts = [f"#{c.index} {shown(c.op)}"]
    if c.module:
        parts.append(shown(c.module))
    if c.phase:
        parts.append(f"({c.phase})")
    if c.source:
        parts.append(shown(c.source))
    return "  ".join(parts)


def _diff_line(s: SliceDiff) -> str:
    figures = f"{s.mismatches} of {s.elements} elements differ"
    if not math.isnan(s.rel_l2):
        figures += f", up to {s.max_ulps} ulp{'s' if s.max_ulps != 1 else ''}, rel_l2 {s.rel_l2:.2g}, " \
                   f"max_abs {s.max_abs:.2g}"
    return f"{s.rows}, {shown(s.output)}: {figures}"


def _reach_line(c: OpCheck) -> str:
    if not c.reaches:
        return "its result reaches no output of the step" + (" (the loss, the gradients)" if c.phase in (
            "forward", "backward") else "")
    what = "the loss" if c.phase == "forward" else "the gradients" if c.phase == "backward" else \
        f"the outputs of its phase ({c.phase})"
    names = ", ".join(f"#{o.index} {shown(o.op)}" for o in c.reaches[:3])
    more = f" and {len(c.reaches) - 3} more" if len(c.reaches) > 3 else ""
    return f"flows into {what}: {names}{more}"


def render_text(r: InvarianceResult, out: TextIO, trace: str = "TRACE") -> None:
    threads = f", {r.threads} thread{'s' if r.threads != 1 else ''}" if r.threads else ""
    out.write(f"checked {len(r.checks)} ops of {shown(trace)} (rank {r.rank}) on {r.device}{threads}, at their "
              f"recorded dtypes, on slices of the batch ({', '.join(str(s) for s in r.rows)}), bit for bit\n")
    out.write(f"  batch of {r.batch_size} read from {shown(r.batch_input)}\n")
    n = {f: r.count(f) for f in Finding}
    out.write(f"  judged: {n[Finding.INVARIANT]} invariant, {n[Finding.VARIANT]} batch-variant\n")
    rest = [f"{n[Finding.NO_BATCH]} without the batch", f"{n[Finding.VIEW]} views or shape-only",
            f"{n[Finding.REDUCES]} reduce the batch away"]
    if n[Finding.MEAN]:
        rest.append(f"{n[Finding.MEAN]} divide by the batch size")
    rest.append(f"{n[Finding.NOT_JUDGED]} could not be judged")
    out.write(f"  not judged: {', '.join(rest)}\n")
    variant = r.variant
    if variant:
        out.write("batch-variant ops (a slice of the batch gives other bits than the same rows of the recording):\n")
        for c in variant[:SHOWN]:
            out.write(f"  {_where(c)}\n")
            worst = c.worst
            if worst is not None:
                out.write(f"    {_diff_line(worst)}\n")
            out.write(f"    {_reach_line(c)}\n")
        if len(variant) > SHOWN:
            out.write(f"  ... and {len(variant) - SHOWN} more (--json lists them all)\n")
    unjudged = [c for c in r.checks if c.finding is Finding.NOT_JUDGED]
    if unjudged:
        out.write("not judged (they read the batch):\n")
        for c in unjudged[:5]:
            out.write(f"  {_where(c)}: {shown(c.reason or '')}\n")
        if len(unjudged) > 5:
            out.write(f"  ... and {len(unjudged) - 5} more\n")
    bad = [k for k in r.kinds if k.variant]
    if bad:
        out.write("per op kind (judged calls: invariant / batch-variant), and what to do:\n")
        width = max(len(k.op) for k in bad)
        for k in bad:
            out.write(f"  {shown(k.op):<{width}}  {k.invariant} / {k.variant}\n")
            if k.advice is not None:
                out.write(textwrap.fill(f"{k.advice.kind}: {k.advice.remedy}", 118, initial_indent="      ",
                                        subsequent_indent="        ") + "\n")
                first = ", ".join(f"#{c.index} {shown(c.source or '(no source line)')}" for c in k.first)
                out.write(f"      first: {first}\n")
    fine = [k for k in r.kinds if not k.variant]
    if fine:
        out.write(textwrap.fill("invariant: " + ", ".join(f"{shown(k.op)} x{k.invariant}" for k in fine), 118,
                                initial_indent="  ", subsequent_indent="    ") + "\n")
    bad_kinds = [k.op for k in r.kinds if k.variant]
    if bad_kinds:
        out.write(f"=> {len(variant)} call{'s' if len(variant) != 1 else ''} of {len(bad_kinds)} kind"
                  f"{'s' if len(bad_kinds) != 1 else ''} of op depend on the batch: {', '.join(bad_kinds)}\n")
    elif unjudged:
        out.write(f"=> no batch-variant op among those judged; {len(unjudged)} op{'s' if len(unjudged) != 1 else ''}"
                  f" that read the batch could not be judged\n")
    elif r.none_judged:
        out.write(f"=> no op reading the batch was judged: none of the {len(r.checks)} ops computes on the rows of "
                  f"the batch read from {shown(r.batch_input)} (not clean: is that the batch? --batch-size B picks "
                  f"another)\n")
    else:
        out.write("=> every op that reads the batch is batch-invariant on these slices\n")


# -- a run on some rows of another's batch (``replaydiff.invariance.rows.RowsDiff``) ---------------------------------
ROWS_FORMAT = "replaydiff.invariance-rows/1"


def rows_to_json(d: RowsDiff, big: str = "BIG", small: str = "SMALL") -> dict:
    def part(p: RowsPart | None) -> dict | None:
        if p is None:
            return None
        return {"big": p.big, "small": p.small, "op": p.op, "module": p.module, "phase": p.phase, "source": p.source,
                "output": p.output, "mismatches": p.mismatches, "elements": p.elements, "max_ulps": p.max_ulps,
                "inputs_agree": p.inputs_agree, "cause": None if p.cause is None else _check_json(p.cause)}

    return {"format": ROWS_FORMAT, "big": big, "small": small, "big_batch": d.big_batch,
            "small_batch": d.small_batch, "rows": [d.rows.start, d.rows.stop], "pairs": d.pairs,
            "compared": d.compared, "parted": part(d.parted), "first_difference": part(d.first_difference),
            "pairing_ends": d.pairing_ends}


def _cause_line(p: RowsPart) -> str:
    c = p.cause
    if c is None or not c.finding.judged and c.finding is not Finding.MEAN:
        why = f"{c.finding.words}: {c.reason}" if c is not None and c.reason else "not checked"
        return f"the check of BIG's op on these rows could not say why ({shown(why)})"
    if c.finding is Finding.VARIANT:
        worst = c.worst
        return ("this op's kernel depends on the batch: BIG's op run on these rows alone does not give the bits it "
                "gave them inside the batch" + (f" ({_diff_line(worst)})" if worst is not None else ""))
    if c.finding is Finding.MEAN:
        return f"this op divides by the batch size ({shown(c.reason or '')})"
    return ("BIG's op run on these rows alone gives BIG's bits: the batch does not explain it (another kernel, "
            "thread count or device in SMALL's run)")


def render_rows_text(d: RowsDiff, out: TextIO, big: str = "BIG", small: str = "SMALL") -> None:
    out.write(f"{shown(small)} ({d.small_batch} row{'s' if d.small_batch != 1 else ''}) is {d.rows} of "
              f"{shown(big)}'s batch of {d.big_batch}; their ops paired in order, each output that holds the batch "
              f"compared on those rows\n")
    if d.pairing_ends:
        out.write(f"  {shown(d.pairing_ends)}: the pairing stops there\n")
    p = d.parted
    if p is not None:
        out.write(f"the rows part at BIG #{p.big} / SMALL #{p.small} {shown(p.op)}  {shown(p.module or '')}  "
                  f"({p.phase})  {shown(p.source or '')}\n")
        out.write(f"  {shown(p.output)}: {p.mismatches} of {p.elements} elements differ, up to {p.max_ulps} ulps; "
                  f"its inputs agree on the rows\n")
        out.write(f"  {_cause_line(p)}\n")
    elif d.first_difference is not None:
        f = d.first_difference
        out.write(f"the rows differ first at BIG #{f.big} / SMALL #{f.small} {shown(f.op)}, whose inputs differ "
                  f"already (an input without the batch, or one the pairing could not cut)\n")
    else:
        out.write(f"=> the rows agree bit for bit at all {d.compared} ops compared ({d.pairs} paired)\n")
