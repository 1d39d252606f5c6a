"""The human-readable replay summary: counts, the culprit with its metrics, and where to look next."""
from __future__ import annotations

from collections import Counter
from typing import TextIO

from replaydiff.aten import is_unit
from replaydiff.rebuild_and_judge import shown
from replaydiff.replay.describe import argument_text, metrics_line, op_line, place, planted_line
from replaydiff.replay.result import NonfiniteInput, OpResult, ReplayReport, Status, nonfinite_counts
from replaydiff.replay.plants import plant_notes
from replaydiff.trace.damage import describe_missing
from replaydiff.trace.schema import LEFT_OUT_DEVICE_PENDING, LEFT_OUT_DISK_FULL

# What to record instead, per reason the recording left tensor data out against its will (the TUI says it too).
_AGAIN = {LEFT_OUT_DISK_FULL: "on a disk with room, or with a --budget that fits it",
          LEFT_OUT_DEVICE_PENDING: "once the device finishes its work (a hung collective shows in `replaydiff show`)"}
_AGAIN_BUDGET = "with a larger --budget, or --module for the part to check"


def record_again(reasons: set[str]) -> str:
    """'record again ...' for ops left out for these reasons (budget, disk full, a device that never finished)."""
    return "record again " + "; or ".join(sorted({_AGAIN.get(r, _AGAIN_BUDGET) for r in reasons}))


def origin_how(r: OpResult) -> str:
    """How an op made the NaN/Inf it is the origin of (``OpResult.nonfinite_origin``)."""
    return "inputs hold Inf but no NaN, NaN in recorded output" if getattr(r, "nonfinite_from_inf", False) else \
        "finite inputs, non-finite recorded output"


def nonfinite_entry_line(r: OpResult, held: NonfiniteInput, ended: str | None = None,
                         report: ReplayReport | None = None) -> str:
    """Where NaN/Inf that no replayed op made come into the step: the op, its input, and where that was written.
    ``ended``: they are discarded, and this says where they end (``ended_by``). Where they came from an op replay
    did not run, the line names the earliest such op whose recorded output holds them (``NonfiniteInput.earliest``;
    ``report``: where its module and line are looked up), not the one that handed them to ``r``."""
    where = shown(", ".join(x for x in (r.module or "no module", r.phase) if x))
    source = shown(place(r).source or "")
    kinds = held.kinds()
    fate = f": {ended}" if ended is not None else ""
    if held.argument is not None:
        return f"{kinds} enter the step as a number passed to an op: {shown(argument_text(held))} of op #{r.index} {shown(r.op)} " \
               f"({where}) puts {held.counts()} in its output{fate}" + (f"  {source}" if source else "")
    discarded = " and are discarded" if ended is not None else ""
    tail = f"  {source}" if source else ""
    if held.producer is not None and held.earliest is not None and held.earliest != held.producer:
        return f"{kinds} enter the step {_earliest_text(held, report)}{discarded}; they reach input {held.position} " \
               f"of op #{r.index} {shown(r.op)} ({where}), the first replayed op to read them, through op " \
               f"#{held.producer} {shown(held.producer_op)}: it already holds {held.counts()}{fate}{tail}"
    whence = "from outside the trace" if held.producer is None else \
        f"from op #{held.producer} {shown(held.producer_op)}, which was not replayed (its data left out)"
    return f"{kinds} enter the step {whence}{discarded}: input " \
           f"{held.position} of op #{r.index} {shown(r.op)} ({where}) already holds {held.counts()}{fate}{tail}"


def _earliest_text(held: NonfiniteInput, report: ReplayReport | None) -> str:
    """'from op #103 aten.native_layer_norm.default (Sequential.1, forward) at train.py:12, which was not replayed
    (...): its recorded outputs are the first to hold them (512 NaN), made from inputs that hold none'."""
    e = None if report is None else next((x for x in report.ops if x.index == held.earliest), None)
    at = ""
    if e is not None:
        loc = place(e)
        at = f" ({shown(', '.join(x for x in (e.module or 'no module', e.phase) if x))})" + \
            (f" at {shown(loc.source)}" if loc.source else "")
    how = ", made from inputs that hold none" if held.earliest_made else \
        f", taken in through its input {held.earliest_input}, written outside the trace" \
        if held.earliest_input is not None else \
        f", put there by a number passed to it ({shown(held.earliest_argument)})" if held.earliest_argument else ""
    counts = nonfinite_counts(held.earliest_nan, held.earliest_inf)
    return f"from op #{held.earliest} {shown(held.earliest_op)}{at}, which was not replayed (its data left out): " \
           f"its recorded outputs are the first to hold them ({counts}){how}"


_NEVER_KEPT = "so they reach no loss, gradient, parameter or output of the step (information, not a fault)"


def ended_by(report: ReplayReport, r: OpResult, most: int = 3) -> str:
    """'followed forward, they end at #43 aten._to_copy.default (finite output), so ...' for an op whose NaN/Inf are
    discarded (``OpResult.nonfinite_discarded_by``: the ops that read them and made only finite values)."""
    names = {x.index: x.op for x in report.ops if x.rank == r.rank}
    ops = r.nonfinite_discarded_by or []
    listed = ", ".join(f"#{i} {shown(names[i])}" if i in names else f"#{i}" for i in ops[:most])
    more = f" and {len(ops) - most} more" if len(ops) > most else ""
    return f"followed forward, they end at {listed}{more} (finite output), {_NEVER_KEPT}" if ops else \
        f"no op keeps them, {_NEVER_KEPT}"


def discarded_lines(report: ReplayReport) -> list[str]:
    """NaN/Inf the step makes, or lets in, and then selects away (T5's log(0) under a where, an additive -inf mask
    through softmax): one line for those made and one for those let in, naming the first of each."""
    lines = []
    made = [r for r in report.nonfinite_discarded if r.nonfinite_origin]
    if made:
        first, others = made[0], made[1:]
        more = f"; {len(others)} more op(s) like it: " + ", ".join(f"#{r.index}" for r in others[:5]) + \
            (" ..." if len(others) > 5 else "") if others else ""
        lines.append(f"NaN/Inf made and discarded: {op_line(first)}: {ended_by(report, first)}{more}")
    let_in = [r for r in report.nonfinite_discarded if not r.nonfinite_origin and r.nonfinite_input is not None]
    if let_in:
        first = let_in[0]
        more = f" ({len(let_in) - 1} more op(s) read such inputs)" if len(let_in) > 1 else ""
        lines.append(nonfinite_entry_line(first, first.nonfinite_input, ended_by(report, first), report) + more)
    return lines


def render_replay(report: ReplayReport, out: TextIO, max_listed: int = 10, entry_said: bool = False) -> None:
    """The replay summary; ``entry_said``: the caller prints a richer line on the same NaN/Inf entry (a zoom-in's
    "the difference enters through"), so this one leaves its own out."""
    c = report.counts()
    opts = report.options
    if report.planted:
        out.write(planted_line(report.planted) + "\n")
    rank_note = ""
    ranks = sorted({r.rank for r in report.ops})
    if len(ranks) > 1:
        rank_note = f" ({len(ranks)} ranks)"
    elif ranks and (ranks[0] != 0 or opts.get("ranks")):  # one rank asked for, or the only one not rank 0: which
        rank_note = f" (rank {ranks[0]})"
    out.write(f"replayed {len(report.ops)} ops of {report.trace}{rank_note} on {opts['device']} at "
              f"{opts['precision']}: " + ", ".join(f"{n} {s}" for s, n in c.items()) + "\n")
    not_judged = report.not_judged
    # Ops left out for the budget or a full disk are skipped too; their own line below says how many and where,
    # so they are not counted again among the skipped reasons.
    told = {id(r) for r in not_judged + report.unjudged}
    skipped = Counter(r.reason for r in report.ops if r.status is Status.SKIPPED and id(r) not in told)
    for reason, n in skipped.most_common(6):
        out.write(f"  skipped {n:>5}  {shown(reason)}\n")
    errors = [r for r in report.ops if r.status is Status.ERROR]
    for r in errors[:max_listed]:
        out.write(f"  error   {op_line(r)}: {shown(r.reason)}\n")
    for line in report.left_out_summary():  # how much the recording left out, and where
        out.write(f"  {shown(line)}\n")
    for line in report.unjudged_summary():  # skipped, yet they computed something: said apart, never clean
        out.write(f"  {shown(line)}\n")
    for line in describe_missing(report.missing):  # a damaged trace: which ops were never judged, and why
        out.write(f"  {line}\n")
    for c in report.cut_short:  # a partial trace: where each rank's recording stopped, and why
        out.write(f"  {c.describe()}\n")
    first = report.first_divergent
    if first is None and report.cut_short:  # what came after the stop was never recorded: never call it clean
        where = "; ".join(f"rank {c.rank}'s after op #{c.last}" if c.last is not None else
                          f"rank {c.rank}'s before its first op" for c in report.cut_short)
        out.write(f"not clean: the trace is partial: the recording stopped part-way ({where}; why above) and what "
                  f"came after was never recorded; no divergent op among the {len(report.ops)} read\n")
    elif first is None and report.missing:  # ops that are gone were not judged: never call the trace clean
        out.write(f"not clean: {sum(m.count for m in report.missing)} op(s) are missing from the trace (listed "
                  f"above), so were not judged; no divergent op among the {len(report.ops)} read\n")
    elif first is None and errors:  # ops that could not be replayed were not checked: do not call them matching
        out.write(f"not clean: {len(errors)} op(s) could not be replayed, so were not judged (listed above); no "
                  f"divergent op among the others\n")
    elif first is None and report.nothing_judged:  # a filter that matched nothing: checking nothing is not clean
        out.write(f"nothing was judged: all {len(report.ops)} ops were skipped (reasons above)\n")
    elif first is None and report.unjudged:  # what they computed is unchecked: never "every op matches"
        judged = sum(r.status in (Status.OK, Status.DIVERGENT, Status.NONDETERMINISTIC) for r in report.ops)
        out.write(f"not clean: no divergent op among the {judged} judged, but {len(report.unjudged)} op(s) that "
                  f"computed part of the step were not judged (listed above)\n")
    elif first is None and not_judged:  # nor were ops whose data the recording left out
        judged = sum(r.status in (Status.OK, Status.DIVERGENT, Status.NONDETERMINISTIC) for r in report.ops)
        out.write(f"not clean: no divergent op among the {judged} judged; "
                  f"{record_again({r.data_left_out for r in not_judged})}\n")
    elif first is None and report.recomputes_differ:
        out.write("not clean: every replayed op matches its recorded output within tolerance, but a recompute does "
                  "not reproduce the forward op it runs again (below)\n")
    elif first is None:
        out.write("no divergent op: every replayed op matches its recorded output within tolerance\n")
    else:
        rank = f"rank {first.rank} " if ranks != [0] else ""  # a trace of rank 1 alone (--rank 1) says so too
        out.write(f"first divergent op {rank}{op_line(first)}\n")
        how = "checked across ranks" if first.collective else "replayed alone from its recorded inputs"
        out.write(f"  {metrics_line(first)}  - {how}\n")
        if is_unit(first.op) and first.reason:  # a compiled unit: its region, and the node inside it
            out.write(f"  {shown(first.reason)}\n")
        ran_by = place(first).origin()
        if ran_by is not None:  # what ran it: the forward op it differentiates or recomputes, the backward() call
            out.write(f"  {shown(ran_by)}\n")
        before = report.missing_before(first)
        if before:  # the earliest among the ops read: an earlier culprit may be among those that are gone
            out.write(f"  the earliest among the ops read: {sum(m.count for m in before)} op(s) before it are "
                      f"missing (listed above), an earlier divergent op may be among them\n")
        per_rank = report.first_per_rank
        if len(per_rank) > 1:
            out.write("  earliest divergent op of each rank (the culprit is the earliest by collective order):\n")
            for r in per_rank:
                mark = ("  <- listed first (order undecided)" if report.undecided else "  <- culprit") \
                    if r is first else ""
                out.write(f"    rank {r.rank} {op_line(r)}{mark}\n")
        if report.undecided:
            which = ", ".join(f"rank {k} #{i}" for k, i in report.undecided)
            out.write(f"  the order between rank {first.rank} #{first.index} and {which} cannot be decided: no "
                      f"collective of a common group lies between them\n")
        others = [r for r in report.ops if r.status is Status.DIVERGENT and r is not first]
        if others:
            out.write(f"  {len(others)} more divergent op(s):\n")
            for r in others[:max_listed]:
                out.write(f"    {f'rank {r.rank} ' if len(ranks) > 1 else ''}{op_line(r)}  {metrics_line(r)}\n")
    for note in plant_notes(report):  # a plant that left replay nothing to find says so, never as a miss
        out.write(note + "\n")
    explained = [r for r in report.ops if r.status is Status.OK and r.verdict is not None and r.verdict.explanation]
    if explained:  # large figures a reader would take for a divergence: say why they are not
        out.write(f"{len(explained)} op(s) over the fixed limits are ok, within their own error at the recorded dtype "
                  f"(ill-conditioned):\n")
        for r in explained[:max_listed]:
            out.write(f"    {f'rank {r.rank} ' if len(ranks) > 1 else ''}{op_line(r)}: {shown(r.verdict.explanation)}\n")
    if report.replicas is not None:
        out.write(report.replicas.describe() + "\n")
    differ = report.recomputes_differ
    if differ:  # the earliest; those after it may differ only because it does
        more = f" ({len(differ) - 1} more recompute(s) after it differ too)" if len(differ) > 1 else ""
        out.write(f"first {differ[0].describe()}{more}\n")
    again = report.recomputes_state
    if again:
        more = f" ({len(again) - 1} more such recompute(s))" if len(again) > 1 else ""
        out.write(f"note: {again[0].describe()}{more}\n")
    nd = report.first_nondeterministic
    if nd is not None:
        n = sum(r.status is Status.NONDETERMINISTIC for r in report.ops)
        out.write(f"nondeterministic: {n} op(s), first {op_line(nd)}\n")
    origin = report.nonfinite_origin
    if origin is not None:
        out.write(f"NaN/Inf origin: {op_line(origin)} ({origin_how(origin)})\n")
    entry = report.nonfinite_entry
    if entry is not None and entry.nonfinite_input is not None and not entry_said:  # they came in with an input
        out.write(nonfinite_entry_line(entry, entry.nonfinite_input, report=report) + "\n")
    for line in discarded_lines(report):
        out.write(line + "\n")
