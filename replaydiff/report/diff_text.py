"""The human-readable diff summary: whether the step's own inputs already differed (said first: then the runs had
parted before the step, and no op of it is where they part), environment differences, then per rank pair the first
divergence (the op whose inputs agree and whose outputs do not), how far the difference spread, and the ops present
on one side only."""
from __future__ import annotations

from collections import Counter
from typing import TextIO

from replaydiff.compare.verdict import output_said
from replaydiff.diff.parallel import Departure
from replaydiff.diff.result import DiffReport, PairResult, PairStatus, RankDiff, Unaligned, UnitPair
from replaydiff.rebuild_and_judge import shown
from replaydiff.report.text import planted_line


def _value(v: object) -> str:
    return "(absent)" if v is None else str(v)


def pair_line(p: PairResult) -> str:
    loc = p.location
    where = shown(loc.where()) if loc is not None else \
        "  ".join(shown(x) for x in (p.module or "", f"({p.phase})" if p.phase else "", p.source or "") if x)
    return f"ref #{p.ref} / target #{p.target} {shown(p.op)}  {where}".rstrip()


def pair_metrics(p: PairResult) -> str:
    return _verdict_figures(p.metrics or {}) or p.reason or ""


def _verdict_figures(m: dict) -> str:
    if "norm_max" in m:
        parts = [f"max_abs/(eps*absmax) {_num(m['norm_max'])} (limit {_num(m.get('limit_max'))})",
                 f"rel_l2/eps {_num(m['norm_rel'])} (limit {_num(m.get('limit_rel'))})",
                 f"rel_l2 {_num(m['rel_l2'])}", f"max_abs {_num(m['max_abs'])}"]
        if m.get("nonfinite_mismatch"):
            parts.append(f"{m['nonfinite_mismatch']} NaN/Inf mismatches")
        return output_said(m) + "  ".join(parts)
    if "mismatches" in m:
        return f"{output_said(m)}{m['mismatches']} elements differ"
    return ""


def _num(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) else str(v)


def _unaligned_line(u: Unaligned) -> str:
    names = Counter(u.names).most_common(3)
    more = len(set(u.names)) - len(names)
    what = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in names) + (f", +{more} more" if more > 0 else "")
    span = f"#{u.first}" if u.first == u.last else f"#{u.first}-#{u.last}"
    where = "  ".join(shown(x) for x in (u.module or "", f"({u.phase})" if u.phase else "") if x)
    return f"{u.side + ' only':<12}{span:<13}{len(u.ops):>4} op(s)  {what}  {where}".rstrip()


def unit_line(u: UnitPair) -> str:
    """A compiled unit of one side and the eager ops of its region in the other, on one line."""
    other = "ref" if u.side == "target" else "target"
    span = f"#{u.eager[0]}" if len(u.eager) == 1 else f"#{u.eager[0]}-#{u.eager[-1]}"
    where = "  ".join(x for x in (u.region or "", u.backend or "", f"({u.phase})" if u.phase else "") if x)
    return (f"compiled unit {u.side} #{u.unit} {shown(u.op)}  {where}, against {other} ops {span} "
            f"({u.matched} of {u.nodes} nodes mapped): {u.status}")


def unit_pair_lines(u: UnitPair) -> list[str]:
    """A compiled unit paired with eager ops as the diff report prints it (the TUI's diff mode shows the same)."""
    lines = [unit_line(u)]
    if u.part is not None:
        eager_side = "ref" if u.side == "target" else "target"
        lines.append(f"  they part at {u.part.describe(eager_side)}")
        lines.append(f"    {_verdict_figures(u.part.verdict.to_json())}")
    elif u.verdict is not None and u.verdict.divergent:
        lines.append(f"  outputs: {_verdict_figures(u.verdict.to_json())}")
    if u.reason:
        lines.append(f"  {u.reason}")
    return lines


def _rank_block(rd: RankDiff, many: bool, out: TextIO, max_listed: int, partial: bool = False) -> None:
    c = rd.counts()
    label = f"ref rank {rd.ref_rank} / target rank {rd.target_rank}" if many else "ops"
    evidence = ", ".join(e.value for e in rd.evidence) or "nothing to compare"
    out.write(f"{label}: {rd.ref_ops} ref ops, {rd.target_ops} target ops, {len(rd.pairs)} aligned ({evidence}): "
              f"{c['same']} same, {c['divergent']} divergent, {c['inherited']} inherited, "
              f"{c['not_compared']} not compared; {c['ref_only']} ref only, {c['target_only']} target only\n")
    if rd.precision:  # autocast on one side: the limits that apply, said once
        out.write("  precision: " + "; ".join(x.describe() for x in rd.precision) + "\n")
    explained = rd.explained
    if explained:
        e = explained[0]
        judged = f"  {e.verdict.output.label()}" if e.verdict is not None and e.verdict.output is not None and \
            e.verdict.output.outputs > 1 else ""
        out.write(f"  {len(explained)} pair(s) differ beyond the fixed limits yet each side's op, replayed here from "
                  f"its own inputs, is right (counted same); first {pair_line(e)}{judged}\n")
    for u in rd.units:
        for line in unit_pair_lines(u):
            out.write(f"  {line}\n")
    first = rd.first_divergent
    if first is not None:
        out.write(f"  first divergence {pair_line(first)}\n")
        out.write(f"    {pair_metrics(first)}\n")
        out.write(f"    {(first.reason or '').split('; ')[-1]} ({first.evidence})\n")
        ran_by = first.location.origin() if first.location is not None else None
        if ran_by is not None:  # the forward op it differentiates or recomputes (the reference's numbers)
            out.write(f"    {ran_by.replace('forward op #', 'forward op ref #')}\n")
        if first.dtypes:
            out.write(f"    output dtype {first.dtypes[0]} in ref, {first.dtypes[1]} in target\n")
        others = [p for p in rd.pairs if p.status is PairStatus.DIVERGENT and p is not first]
        if others:
            out.write(f"    {len(others)} more op(s) introduced differences of their own, first "
                      f"{pair_line(others[0])}\n")
        if c["inherited"]:
            out.write(f"    {c['inherited']} later op(s) inherited a difference\n")
    else:
        diff = rd.first_difference
        if diff is not None:
            origin = diff.inherited_from.describe() if diff.inherited_from else "inputs that already differed"
            out.write(f"  no aligned op introduced a difference; differences enter from {origin}, first seen at "
                      f"{pair_line(diff)}\n")
        elif partial and not any(u.status in (PairStatus.DIVERGENT, PairStatus.INHERITED) for u in rd.units):
            out.write("  no difference among the ops both traces hold; not clean: a trace is partial (below)\n")
        elif not any(u.status in (PairStatus.DIVERGENT, PairStatus.INHERITED) for u in rd.units):
            out.write("  no op introduced a difference: every other compared op pair agrees within tolerance\n" if explained
                      else "  no difference: every compared op pair agrees within tolerance\n")
    runs = sorted(rd.ref_only + rd.target_only, key=lambda u: (u.first, u.side))  # roughly in step order
    if runs:
        out.write(f"  structural differences ({len(runs)} run(s) of unaligned ops):\n")
        for u in runs[:max_listed]:
            out.write(f"    {_unaligned_line(u)}\n")
        if len(runs) > max_listed:
            out.write(f"    ... {len(runs) - max_listed} more (--json for all)\n")


def _rank_labels(report: DiffReport) -> bool:
    """Whether each rank pair's lines name its ranks: more than one pair, or one that is not rank 0 of both (a
    ``record --ranks 1`` trace of a 2-rank job diffed alone)."""
    return len(report.ranks) > 1 or any((rd.ref_rank, rd.target_rank) != (0, 0) for rd in report.ranks)


def _step_inputs_lines(report: DiffReport) -> list[str]:
    """One line per rank pair whose step began from inputs that already differed."""
    lines = []
    advice = None
    many = _rank_labels(report)
    for rd in report.step_inputs_differ:
        si = rd.step_inputs
        first = si.first
        assert first is not None
        ranks = f"ref rank {rd.ref_rank} / target rank {rd.target_rank}: " if many else ""
        lines.append(f"{ranks}inputs of the step already differ: {si.differ} of {si.compared} tensors from outside "
                     f"the trace, first {first.describe()}: {_verdict_figures(first.verdict.to_json())}")
        advice = advice or _parted_advice(first.step, si.first_step)
    if advice:
        lines.append(f"  (parameters, optimizer state, batch or buffers: {advice})")
    return lines


def _parted_advice(step: int | None, first_step: int | None) -> str:
    """Where to look for a step input that differs: it first differs at ``step`` of traces that begin at
    ``first_step``. Only a difference already there at the trace's first step, a step after the first, calls for an
    earlier recording."""
    if step is None or first_step is None:
        return "the runs had parted before this step; record an earlier step, or the first, to find where"
    if step > first_step:
        return f"they first differ at step {step}, inside the traces (which begin at step {first_step}): written " \
               f"between recorded ops, or by the steps before it (see the ops below)"
    if first_step <= 1:
        return f"they differ from step {step}, the first: the runs began apart (initial weights, seed, first batch)"
    return f"they differ from step {step}, the traces' first: the runs had parted before it; record from an " \
           f"earlier step, or the first, to find where"


def render_diff(report: DiffReport, out: TextIO, max_listed: int = 10) -> None:
    if report.planted:
        out.write(planted_line(report.planted) + "\n")
    base = f" (tolerances from baseline {report.baseline})" if report.baseline else ""
    out.write(f"diff of {report.target} against {report.ref}{base}\n")
    if report.steps:
        out.write(report.steps + "\n")
    for line in _step_inputs_lines(report):
        out.write(line + "\n")
    if report.environment:
        out.write(f"environment: {len(report.environment)} difference(s)\n")
        for d in report.environment[:max_listed * 2]:
            out.write(f"  {d.key}: {_value(d.ref)} -> {_value(d.target)}\n")
            if d.hint:
                out.write(f"    hint: {d.hint}\n")
    else:
        out.write("environment: same\n")
    partial = bool(report.cut_short)
    if report.parallel is not None:
        render_parallel(report.parallel, out, partial)
    for rd in report.ranks:
        _rank_block(rd, _rank_labels(report), out, max_listed, partial)
    for side, c in report.cut_short:  # what came after the stop was never recorded: never compared, never clean
        out.write(f"not clean: the {side} trace is partial: {c.describe()}; what came after was never recorded, so "
                  f"not compared\n")
    cands = report.candidates()
    if len(report.ranks) > 1 and cands:
        out.write("first divergences, earliest first:\n")
        for rd, p in cands:
            out.write(f"  target rank {rd.target_rank}: {pair_line(p)}\n")


def _parallel_op_line(op) -> str:
    line = op.source or ""
    if op.target_source:
        line = f"{line or 'no line'} (on the ranks {op.target_source})"
    where = "  ".join(shown(x) for x in (op.module or "", f"({op.phase})" if op.phase else "", line) if x)
    if len(op.ranks) == 1:
        ranks = f"rank {op.ranks[0]} #{op.targets[0]}"
    elif op.ranks:
        ranks = f"ranks {'/'.join(map(str, op.ranks))} " + "/".join(f"#{t}" for t in op.targets)
    else:
        ranks = "ranks " + "/".join(f"#{t}" for t in op.targets)
    ref = f"ref #{op.ref}" if op.ref_rank is None else f"ref rank {op.ref_rank} #{op.ref}"
    return f"{ref} / {ranks} {shown(op.name)}  {where}".rstrip()


def _worst(pd) -> str:
    """The tensor that maps nearest its limit: its error against its own limit, and the op."""
    if pd.worst_limit is None:
        return f"worst rel_l2 {pd.worst:.3g} eps of the recorded dtype"
    op = next((o for o in pd.ops if o.ref == pd.worst_op), None)
    at = "" if op is None or not pd.worst else f" {op.name}" + (f" ({op.phase})" if op.phase else "")
    bound = pd.worst_bound
    how = "sqrt(eps)" if bound is None else bound.describe()
    return f"worst rel_l2 {pd.worst:.3g} eps of the recorded dtype against its limit of {pd.worst_limit:.3g} eps " \
           f"({how}){f', at ref #{pd.worst_op}{at}' if at else ''}"


def _site_line(d) -> str:
    """One value that parts, on one line: where, and how the ranks hold it (with its factor)."""
    line = d.op.source or ""
    if d.op.target_source:
        line = f"{line or 'no line'} (on the ranks {d.op.target_source})"
    where = "  ".join(x for x in (f"({d.op.phase})" if d.op.phase else "", line) if x)
    held = d.why if d.tensor.layout is None else d.tensor.layout.describe()
    through = f", on the ranks through {d.via}" if d.via and d.tensor.layout is not None else ""
    return f"ref #{d.op.ref} {d.op.name}  {where}: {held}{through}"


def render_parallel(pd, out: TextIO, partial: bool = False) -> None:
    """A parallel run mapped onto the single process (diff/parallel.py): the layouts seen, then the verdict."""
    if pd.ref_world > 1:
        m = pd.world // pd.ref_world
        out.write(f"{pd.world} ranks against {pd.ref_world} ranks: each reference rank q mapped, as a single process, "
                  f"onto ranks {m}q to {m}q+{m - 1} (its share of the global batch), each aligned op's values through "
                  f"their layout\n")
    else:
        out.write(f"{pd.world} ranks against one process: each aligned op's values mapped onto the single process's "
                  f"through their layout\n")
    out.write(f"ops: {pd.ref_ops} ref ops, {pd.aligned} run by every rank, {pd.compared} compared"
              + (f", {len(pd.not_aligned)} not run by every rank" if pd.not_aligned else "")
              + (f", {pd.random_ops} random (compared only where every rank drew the single process's numbers)"
                 if pd.random_ops else "")
              + (f", {pd.not_stored} without tensor data (record --tensors full)" if pd.not_stored else "") + "\n")
    if pd.micro_batches:
        k = pd.micro_batches // pd.world
        mine = "micro-batch r's" if k == 1 else f"micro-batches {k}r to {k}r+{k - 1}, pass by pass"
        out.write(f"  the single process runs the global batch as {pd.micro_batches} micro-batches, gradients "
                  f"accumulated: rank r's forward and backward mapped onto {mine}, the rest onto every rank's\n")
    if pd.rank_micro_batches:
        k = pd.rank_micro_batches
        out.write(f"  each rank runs its share of the global batch as {k} micro-batches, gradients accumulated: the "
                  f"single process's forward and backward mapped onto the {pd.world} x {k} micro-batches in rank "
                  f"order, the rest onto every rank's\n")
    for phase in ("forward", "backward", "optimizer", "?"):
        fam = pd.families.get(phase)
        if fam:
            what = ", ".join(f"{n} {f}" for f, n in fam.most_common())
            out.write(f"  {phase if phase != '?' else 'other'} outputs: {what}\n")
    even = Counter({n: c for n, c in pd.layout_ops.items() if n not in pd.uneven_ops})
    if even:
        names = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in even.most_common(6))
        more = len(even) - 6
        out.write(f"  layout ops (on the ranks only, all ranks together): {names}"
                  + (f", +{more} more" if more > 0 else "") + "\n")
    if pd.uneven_ops:
        names = "; ".join(f"{n} ({', '.join(f'rank {r} x{c}' for r, c in enumerate(counts) if c)})"
                          for n, counts in list(pd.uneven_ops.items())[:6])
        out.write(f"  ops some ranks run and others do not: {names}\n")
    if pd.from_placements is not None:
        n, m = pd.from_placements
        out.write(f"  layouts: {n} of {n + m} compared tensors as DTensor's recorded placements declare them, {m} "
                  f"inferred from shapes and values\n")
    if pd.ref_layout_ops:
        names = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in pd.ref_layout_ops.most_common(6))
        out.write(f"  layout ops of the reference (its own collectives, all its ranks together): {names}\n")
    if pd.micro_batches and pd.ref_only:
        names = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in pd.ref_only.most_common(6))
        out.write(f"  reference-only ops (the accumulation over micro-batches, the loss divided by their count): "
                  f"{names}\n")
    d = pd.departure
    if pd.random_parted:
        n = len(pd.random_parted)
        out.write(f"not judged: {n} op(s) read random draws (dropout, a batch drawn inside the step) that each rank makes its own and part from the "
                  f"reference there, first ref #{pd.random_parted[0]}: record with dropout off (p=0), and the batch made before the step, to compare them\n")
    if pd.same_draws:
        out.write(f"  every rank drew the same numbers at {len(pd.same_draws)} random op(s), first ref #{pd.same_draws[0]}: "
                  f"each rank's slice masked alike, where the single process draws apart for every row (the same seed on "
                  f"every rank; seed each rank's dropout apart)\n")
    if pd.per_rank_index:
        out.write(f"  {len(pd.per_rank_index)} op(s) make each rank's own index from its local sizes (arange over "
                  f"the local batch, positions, the order that groups its own tokens by expert, where its experts' "
                  f"rows end), not a piece of the single process's: not compared, what they index is, first ref "
                  f"#{pd.per_rank_index[0]}\n")
    if pd.rows_reordered is not None:
        out.write(f"  the ranks hold the single process's rows of the batch between them in another order (a "
                  f"DistributedSampler interleaves its shards: rank r takes rows r, r+W, ...), first ref "
                  f"#{pd.rows_reordered}: the same global batch; what parts only by that order is not a departure\n")
    if pd.amplified:
        out.write(f"  {len(pd.amplified)} op(s) part from the reference only by amplifying their inputs' rounding (every "
                  f"rank holds the same inputs, and its op is right given them: ill-conditioned, such as AdamW's first "
                  f"update of a near-zero gradient), first ref #{pd.amplified[0]}\n")
    if d is None:
        if pd.settings:
            out.write("  the optimizer's settings differ, though what the job keeps agrees: "
                      + "; ".join(st.describe() for st in pd.settings) + "\n")
        if pd.random_parted:
            out.write(f"no op parts from the reference among the others ({pd.compared - n} compared); not clean: "
                      f"the ops above were not judged\n")
        elif pd.compared and partial:
            out.write(f"no op parts from the reference among the {pd.compared} compared; not clean: a trace is "
                      f"partial (below)\n")
        elif pd.compared and pd.cancelled:
            out.write(f"  values that part on the way and reach what the job keeps no longer apart (information, "
                      f"not a departure):\n")
            for c in pd.cancelled:
                out.write(f"    {_site_line(c)}\n")
            if pd.restored:
                out.write(f"    brought back to the single process's by {pd.restored}\n")
            how = "the factors above cancel" if all(c.kind is Departure.SCALED for c in pd.cancelled) else \
                "the values above cancel or feed nothing kept"
            out.write(f"agree at the sinks: the {pd.sinks} compared ops whose values the job keeps (the gradients as "
                      f"the optimizer reads them, the parameters after the step, the optimizer's state, buffers) map "
                      f"onto the single process's; {how} ({_worst(pd)})\n")
        elif pd.compared:
            out.write(f"agree: every compared op maps onto the single process ({_worst(pd)}: a reordered sum)\n")
        else:
            out.write("nothing compared: no aligned op has tensor data on both sides\n")
        return
    if d.enters is not None:  # an op only the ranks run applies the factor: where it enters, then where it shows
        e = d.enters
        where = "  ".join(shown(x) for x in (f"({e.phase})" if e.phase else "", e.source or "") if x)
        only = "which only the ranks run" if e.alone is None else f"which only {e.who()} runs"
        out.write(f"the runs part at rank {e.rank} #{e.index} {shown(e.name)}  {where}, {only}\n")
        out.write(f"  {e.describe()}\n")
        held = d.why if d.tensor.layout is None else \
            f"{d.tensor.layout.describe()}: {e.factor}x what a correct parallel run holds here"
        out.write(f"  it shows at {_parallel_op_line(d.op)}: {held}\n")
    else:
        out.write(f"the runs part at {_parallel_op_line(d.op)}\n")
        out.write(f"  {d.why}\n")
    if d.earlier:
        out.write(f"  {d.earlier}\n")
    for st in pd.settings:
        out.write(f"  the optimizer's settings differ: {st.describe()}\n")
    if pd.sink is not None and pd.sink.op.ref != d.op.ref:
        t = pd.sink.tensor
        held = "under no layout" if t.layout is None else t.layout.describe()
        out.write(f"  it reaches what the job keeps at {_parallel_op_line(pd.sink.op)}: "
                  f"{'input' if t.kind == 'in' else 'output'} {t.position} ({t.describe}) {held}\n")
    if pd.sites and pd.sink is not None and pd.sink.tensor.layout is not None and \
            (len(pd.sites) > 1 or pd.sites[0].op.ref != d.op.ref):
        out.write("  the values on its way that apply a factor, in order:\n")
        for c in pd.sites:
            out.write(f"    {_site_line(c)}\n")
        if pd.sink is not None and pd.sink.tensor.layout is not None:
            out.write(f"    net at the sink: {pd.sink.tensor.layout.describe()}\n")
    for c in pd.cancelled:
        out.write(f"  (cancels before the sinks: {_site_line(c)})\n")
    if d.kind is Departure.INPUTS:
        w = pd.within
        if w is None:
            out.write("  no op parts from the reference with agreeing inputs: every op that parts in this step reads "
                      "what those inputs made\n")
        else:
            out.write(f"  the first op that parts with agreeing inputs: {_parallel_op_line(w.op)}: {w.why}\n")
    if d.tensor.declared is not None:
        out.write(f"  DTensor's placements of this tensor on the ranks: {d.tensor.declared.describe()} (layout "
                  f"{'from placements' if d.tensor.layout_from == 'placements' else 'inferred'})\n")
    if d.inherited:
        out.write(f"  {d.inherited} later op(s) part from the reference too (they read what it made)\n")
