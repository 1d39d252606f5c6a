"""Rendering what ``show`` says of a trace (``replaydiff.trace.summary``): the summary of each rank, one op whole, and
the op list; each as text and as JSON (``replaydiff.show/1``, ``replaydiff.op/1``, ``replaydiff.oplist/1``)."""
from __future__ import annotations

import json
from typing import Any, TextIO

from replaydiff.errors import say
from replaydiff.rebuild_and_judge import shown
from replaydiff.record.budget import format_bytes as _human
from replaydiff.trace import OpRecord, TensorRef, describe_missing
from replaydiff.trace.damage import MissingOps
from replaydiff.trace.schema import LEFT_OUT_BUDGET, Environment, value_json
from replaydiff.trace.summary import OpDetail, OpListing, RankSummary, ShowSummary
from replaydiff.trace.sync import GroupArrival, RankProgress

OP_JSON_FORMAT = "replaydiff.op/1"
SUMMARY_FORMAT = "replaydiff.show/1"  # `show --json` of a whole trace
OP_LIST_FORMAT = "replaydiff.oplist/1"


def to_json(summary: ShowSummary) -> dict:
    """``show --json`` of a whole trace (schema replaydiff.show/1)."""
    progress_json = [{"rank": p.rank, "complete": p.complete,
                      "last_op": None if p.last_op is None else p.last_op.index,
                      "entered": None if p.entered is None else {"index": p.entered.index,
                                                                "op": p.entered.name}} for p in summary.progress]
    return {"format": SUMMARY_FORMAT, "trace": summary.trace, "ranks": [_rank_json(s) for s in summary.ranks],
            "collectives": [g.to_json() for g in summary.groups], "progress": progress_json}


def _rank_json(s: RankSummary) -> dict:
    return {"rank": s.rank, "ops": s.ops, "complete": s.complete, "stopped": s.stopped,
            "planted": s.planted.describe() if s.planted is not None else None,
            "truncated_after": s.truncated_after, "bytes_missing": s.bytes_missing,
            "missing_ops": [m.to_json() for m in s.missing_ops], "phases": s.phases,
            "most_frequent": s.most_frequent, "distinct_ops": s.distinct_ops, "bytes_on_disk": s.bytes_on_disk,
            "tensors": s.tensors, "lost": s.lost, "budget": s.budget,
            "left_out": [{"reason": x.reason, "ops": x.ops, "first": x.first, "last": x.last, "bytes": x.nbytes,
                          "runs": [list(r) for r in x.runs], "runs_in_all": x.nruns} for x in s.left_out],
            "compiled": [c.to_wire() for c in s.compiled], "environment": s.environment.to_json(),
            "corrupt": [{"file": e.path, "problem": e.problem} for e in s.corrupt]}


def _state(s: RankSummary) -> str:
    """How the recording of a rank ended: read to the end, or why not."""
    if s.corrupt and not (s.missing_ops or s.bytes_missing):
        more = f"; and {len(s.corrupt) - 1} more file(s)" if len(s.corrupt) > 1 else ""
        return f"DAMAGED: {s.corrupt[0]}{more}"
    if not s.complete:
        return f"TRUNCATED after op {s.truncated_after}"
    if s.missing_ops:
        return "DAMAGED: " + "; ".join(describe_missing(s.missing_ops, most=3)) + \
            "; replay judges the other ops and lists these, other verbs refuse the trace"
    if s.bytes_missing:
        return (f"DAMAGED: {_human(s.bytes_missing)} of its op and data files are missing or cut short since it "
                f"was written (copied in part?); replay refuses it, naming the file")
    if s.stopped:
        return f"STOPPED part-way: {s.stopped}"
    if any(x.reason == LEFT_OUT_BUDGET for x in s.left_out):
        return "budget reached"
    return "complete"


def render_text(summary: ShowSummary, out: TextIO) -> None:
    """The summary of each rank, the environment, and the collectives not completed by every rank."""
    path, summaries = summary.trace, summary.ranks
    total = sum(s.bytes_on_disk for s in summaries)
    planted = [s.planted.describe() for s in summaries if s.planted is not None]
    if planted:  # the first line of every report on such a trace
        out.write("PLANTED FAULT (record --plant): " + shown("; ".join(planted)) + "\n")
    out.write(f"trace {shown(path)}: {len(summaries)} rank(s), {sum(s.ops for s in summaries)} ops, "
              f"{_human(total)} on disk\n")
    for s in summaries:
        state = _state(s)
        phases = ", ".join(f"{shown(k)} {v}" for k, v in sorted(s.phases.items()))
        out.write(f"\nrank {s.rank}: {s.ops} ops ({state}; tensors={s.tensors}; "
                  f"{_human(s.bytes_on_disk)})\n  phases: {phases}\n  most frequent of {s.distinct_ops} "
                  f"distinct ops:\n")
        for name, n in s.most_frequent:
            out.write(f"    {n:>6}  {shown(name)}\n")
        if s.budget:
            out.write(f"  budget: {_human(s.budget)} (record --budget)\n")
        for x in s.left_out:
            out.write(f"  LEFT OUT: {shown(x.describe())}\n")
        for lost in s.lost:
            out.write(f"  LOST: {shown(lost)}\n")
        for e in s.corrupt[0 if s.missing_ops or s.bytes_missing else 1:]:  # each file, below the state line
            out.write(f"  DAMAGED: {shown(e)}\n")
        for c in s.compiled:
            units = " as compiled units" if c.units else ""
            out.write(f"  COMPILED: {shown(c.region)} ran {shown(c.how)}{units} ({c.calls} call(s))\n")
    env = summaries[0].environment if summaries else Environment()
    out.write("\n" + shown(f"environment (rank {summaries[0].rank if summaries else 0}): torch {env.torch}, "
                    f"cuda {env.cuda}, cudnn {env.cudnn}, nccl {env.nccl}, "
                    f"host {env.hostname}, world size {env.world_size}, threads {env.num_threads}") + "\n")
    for d in env.devices:
        out.write(f"  device {d.index}: {shown(d.name)} (capability {list(d.capability)})\n")
    out.write("  flags: " + shown(", ".join(f"{k}={v}" for k, v in env.flags.recorded)) + "\n")
    variables = env.variables
    if variables:
        out.write("  variables: " + shown(", ".join(f"{k}={v}" for k, v in variables.items())) + "\n")
    render_hang(summary.groups, summary.progress, out)


def _op_brief(op: OpRecord | None) -> str:
    if op is None:
        return "none"
    where = "  ".join(shown(x) for x in (op.module or "", f"({op.phase})" if op.phase else "", op.source or "") if x)
    return f"#{op.index} {shown(op.name)}  {where}".rstrip()


def render_hang(groups: list[GroupArrival], ranks: list[RankProgress], out: TextIO) -> None:
    """The "who didn't arrive" section: printed when a rank is inside a collective or the ranks' collectives
    disagree (a hang, a rank that skipped a collective, a job killed mid-step)."""
    if not groups and not any(p.entered is not None for p in ranks):
        return
    out.write("\ncollectives not completed by every rank:\n")
    for g in groups:
        waiting = "".join(f"; rank {r} waiting in op #{i}" for r, i in sorted(g.waiting.items()))
        out.write(f"  group {shown(g.group_name)} ranks {list(g.ranks)}: collective #{g.call} of the group "
                  f"({shown(g.op)}): "
                  f"entered by ranks {g.entered}, never by ranks {g.never}{waiting}\n")
        if g.not_in_trace:
            out.write(f"    ranks {g.not_in_trace} of the group have no trace here\n")
    for p in ranks:
        state = "recording finished" if p.complete else "recording cut short"
        inside = f"; inside collective op #{p.entered.index} {shown(p.entered.name)}" if p.entered is not None else ""
        out.write(f"  rank {p.rank}: last completed op {_op_brief(p.last_op)} ({state}){inside}\n")


def _tensor_text(ref: TensorRef, producer: int | None = None, consumers: list[int] | None = None,
                 links: bool = False) -> str:
    s = f"tensor {ref.describe()} stride {list(ref.stride) if ref.stride is not None else None} " \
        f"offset {ref.offset} {ref.device}"
    if ref.unsupported:
        s += f" (not stored: {ref.unsupported})"
    if ref.uninitialised:
        s += " (uninitialised)"
    if ref.conj or ref.neg:
        s += " (" + ", ".join(b for b, on in (("conj", ref.conj), ("neg", ref.neg)) if on) + " bit)"
    st = ref.stats
    if st is not None:
        s += f" mean {st.mean:.4g} absmax {st.absmax:.4g} l2 {st.l2:.4g} var {st.var:.4g} nan {st.nan} inf {st.inf}"
    if links and consumers is None:
        s += f"  <- op #{producer}" if producer is not None else "  <- from outside the trace"
    if consumers:
        s += "  -> ops " + ", ".join(f"#{c}" for c in consumers[:8]) + (" ..." if len(consumers) > 8 else "")
    return shown(s)


class _Positions:
    """Hands out input/output positions in the order OpRecord.inputs() / outputs_refs() number them."""

    def __init__(self, links: dict) -> None:
        self.links, self.k = links, 0

    def next(self) -> Any:
        v = self.links.get(self.k)
        self.k += 1
        return v


def _value_text(v: Any, pos: _Positions | None, inputs: bool) -> str:
    if isinstance(v, TensorRef):
        link = pos.next() if pos is not None else None
        return _tensor_text(v, link, None, True) if inputs else _tensor_text(v, None, link)
    if isinstance(v, list) and any(isinstance(x, TensorRef) for x in v):
        return "[\n" + "".join(f"        {_value_text(x, pos, inputs)}\n" for x in v) + "      ]"
    return json.dumps(value_json(v))


def render_op(d: OpDetail, out: TextIO) -> None:
    """``show --op N``: the op record whole, each tensor with the op that wrote it or the ops that read it."""
    op = d.op
    if d.planted is not None:
        out.write(f"PLANTED FAULT (record --plant): {shown(d.planted.describe())}\n")
    out.write(f"op #{op.index} {shown(op.name)}  rank {d.rank}\n")
    if not op.recorded:
        out.write(f"  not recorded: {shown(op.not_recorded_reason)}\n")
    loc = d.location  # the one definition every report uses (trace/location.py)
    out.write(f"  phase   {shown(loc.phase_text or None)}\n  module  {shown(loc.module)}\n  source  {shown(loc.source)}"
              f"{'  ' + shown(loc.source_text) if loc.source_text else ''}"
              f"{'  (of the forward op)' if loc.of_forward else ''}\n")
    ran_by = loc.origin()
    if ran_by is not None:
        out.write(f"  ran by  {shown(ran_by)}\n")
    if d.source_warning:  # the recorded text above is what ran; the file here is another one
        out.write(f"          {shown(d.source_warning)}\n")
    if op.schema:
        out.write(f"  schema  {shown(op.schema)}\n")
    fwd = d.forward
    if fwd is not None:
        out.write(f"  forward op #{fwd.index} {shown(fwd.name)} ({shown(fwd.source)})\n")
    if op.rng is not None:
        out.write(f"  random: generator state recorded ({op.rng.device})\n")
    unit = op.unit
    if unit is not None:  # a compiled unit: its graph's nodes and the backend's kernels
        calls = unit.calls()
        out.write(f"  unit    {shown(unit.kind)} graph {unit.graph_id} of {shown(unit.region)}, compiled by "
                  f"{shown(unit.backend)}: "
                  f"{len(calls)} nodes, {len(unit.kernels)} kernels\n")
        if unit.note:
            out.write(f"          {shown(unit.note)}\n")
        if unit.kernels:
            out.write(f"  kernels {shown(', '.join(unit.kernels))}\n")
        for n in calls:
            out.write(f"    {shown(n.name)} = {shown(n.target)}{'  in ' + shown(n.module) if n.module else ''}\n")
    c = op.collective
    if c is not None:
        out.write(f"  collective: group {shown(c.group_name)} ranks {list(c.ranks)} (size {c.size}, this rank "
                  f"{c.group_rank}), reduce {c.reduce_op}, root {c.root}\n")
    if not op.recorded:
        return
    ins = _Positions(d.producers)
    out.write("  arguments:\n")
    for i, a in enumerate(op.args):
        out.write(f"    [{i}] {_value_text(a, ins, True)}\n")
    for k, v in op.kwargs.items():
        out.write(f"    {shown(k)}= {_value_text(v, ins, True)}\n")
    for path, after in op.writes:
        out.write(f"  writes {path.kind} {path.key}, after: {_value_text(after, None, False)}\n")
    outs = _Positions(d.consumers)
    out.write(f"  outputs{' (uninitialised)' if op.uninitialised else ''}:\n")
    values = op.outputs if isinstance(op.outputs, list) else [op.outputs]
    for i, o in enumerate(values):
        out.write(f"    [{i}] {_value_text(o, outs, False)}\n")


def op_to_json(d: OpDetail) -> dict:
    """``show --op N --json``: the typed record with its graph edges (schema replaydiff.op/1)."""
    doc = {"format": OP_JSON_FORMAT, **d.op.to_json()}
    if d.op.recorded:
        doc["producers"] = {str(k): v for k, v in d.producers.items()}
        doc["consumers"] = {str(k): v for k, v in d.consumers.items()}
    return doc




def list_to_json(listing: OpListing) -> dict:
    """``show --list --json`` (schema replaydiff.oplist/1)."""
    idx, gone = listing.index, listing.gone
    return {"format": OP_LIST_FORMAT, "trace": listing.trace, "rank": listing.rank,
            "ops": [{"index": i, "op": idx.name[i], "module": idx.module[i], "phase": idx.phase[i],
                     "output": idx.output[i], "recorded": idx.recorded[i], "recompute_of": idx.recompute[i],
                     "missing": _missing_cell(gone[i]) if i in gone else None} for i in listing.rows]}


def _missing_cell(m: MissingOps) -> str:
    """The last column of a missing op's row: 'missing: ops file F (deleted or never copied)'."""
    return f"missing: ops file {m.path} ({m.problem})" if m.file_known else f"missing: {m.problem}"


def render_list(listing: OpListing, out: TextIO) -> None:
    """Columns: number, op, module ('-': none), phase ('backward, recompute of #N' for a checkpointed op run again),
    first output ('not recorded' for an op a filter left out; 'missing: ops file F' for an op whose record is gone
    from a damaged trace)."""
    idx, rows, gone = listing.index, listing.rows, listing.gone
    if not rows:
        return
    lo, hi = rows[0], rows[-1] + 1
    names, modules, phases = idx.name[lo:hi], idx.module[lo:hi], idx.phase[lo:hi]
    outputs, recorded, recomputes = idx.output[lo:hi], idx.recorded[lo:hi], idx.recompute[lo:hi]
    ks = [i - lo for i in rows]
    w_num = len(str(rows[-1]))

    def phase(k: int) -> str:
        p = shown(phases[k] or "-")
        return p if recomputes[k] is None else f"{p}, recompute of #{recomputes[k]}"

    cells = {k: (shown(names[k]), shown(modules[k] or "-"), phase(k)) for k in ks}
    w_name = max(len(c[0]) for c in cells.values())
    w_mod = max(len(c[1]) for c in cells.values())
    w_phase = max(len(c[2]) for c in cells.values())

    def last(k: int) -> str:
        if lo + k in gone:
            return _missing_cell(gone[lo + k])
        return shown(outputs[k] or "-") if recorded[k] else "not recorded"

    out.writelines(f"{lo + k:>{w_num}}  {cells[k][0]:<{w_name}}  {cells[k][1]:<{w_mod}}  "
                   f"{cells[k][2]:<{w_phase}}  {last(k)}\n" for k in ks)


def list_warnings(listing: OpListing, out: TextIO) -> None:
    """The lines on stderr after a list: no op passed the filters; this rank is damaged (its missing ops); or,
    though this one lists whole, another rank is."""
    if not listing.rows:
        say(f"no op of rank {listing.rank} passes these filters", out)
    for c in listing.cut_short:
        say(f"the trace is partial: {c.describe()}", out)
    if listing.missing:
        for missing in describe_missing(listing.missing):
            say(f"rank {listing.rank} is damaged: {missing}", out)
        return
    if listing.bytes_missing:
        say(f"rank {listing.rank} is damaged: {_human(listing.bytes_missing)} of its op and data files are missing or "
            f"cut short since it was written (`replaydiff show {listing.trace}` names them)", out)
    for o in listing.damaged_others:
        say(f"rank {o} is damaged (`replaydiff show {listing.trace} --list --rank {o}` marks its missing ops)", out)
