"""Summarise a trace (ranks, ops per phase, most frequent ops, bytes, environment), print one op whole (--op N), or
list its ops one line each (--list, filtered by --op GLOB, --module GLOB, --phase, --from/--to)."""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

from replaydiff.aten import matches_any
from replaydiff.errors import EXIT_OK, EXIT_TRACE, UsageError
from replaydiff.record.budget import format_bytes as _human
from replaydiff.replay.engine import check_op_range
from replaydiff.trace import OpRecord, RankTrace, TensorRef, TraceIndex, describe_missing, open_trace
from replaydiff.trace.damage import MissingOps
from replaydiff.trace.reader import Trace
from replaydiff.trace.schema import LEFT_OUT_BUDGET, PHASES, Environment
from replaydiff.trace.sync import GroupArrival, RankProgress, arrivals, progress

OP_JSON_FORMAT = "replaydiff.op/1"
SUMMARY_FORMAT = "replaydiff.show/1"  # `show --json` of a whole trace

NAME = "show"
HELP = "summarise a trace, print one op with --op N, or list ops with --list"


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace directory")
    p.add_argument("--op", metavar="N|GLOB", help="print op N whole; with --list, list only ops whose name matches "
                                                 "GLOB, e.g. 'aten.*mm*'")
    p.add_argument("--rank", type=int, default=None,
                   help="rank to show (default: all for the summary, the first for --op and --list)")
    p.add_argument("--top", type=int, default=10, help="how many of the most frequent ops to list")
    add_list_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _bytes_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def rank_summary(r: RankTrace, top: int) -> dict[str, Any]:
    idx = r.index  # columns only: no op chunk is decoded for the summary
    phases: Counter = Counter()
    ops: Counter = Counter()
    n = 0
    for i in range(len(idx)):
        if not idx.recorded[i]:
            continue
        n += 1
        phases[idx.phase[i] or "?"] += 1
        ops[idx.name[i]] += 1
    env = r.environment
    return {
        "rank": r.rank,
        "ops": n,
        "complete": r.complete,
        "stopped": r.stopped,
        "planted": r.planted.describe() if r.planted is not None else None,
        "truncated_after": r.truncated_after,
        "bytes_missing": r.bytes_missing,
        "missing_ops": list(r.missing_ops),
        "phases": dict(phases),
        "most_frequent": ops.most_common(top),
        "distinct_ops": len(ops),
        "bytes_on_disk": _bytes_on_disk(r.root),
        "tensors": r.options.tensors,
        "lost": r.lost,
        "budget": r.options.budget,
        "left_out": r.data_left_out,  # LeftOut; _summary_json writes them as objects
        "compiled": r.compiled_regions,  # CompiledRegion and Environment: _summary_json writes them as stored
        "environment": env,
    }


def _summary_json(s: dict[str, Any]) -> dict[str, Any]:
    return dict(s, compiled=[c.to_wire() for c in s["compiled"]], environment=s["environment"].to_json(),
                missing_ops=[m.to_json() for m in s["missing_ops"]],
                left_out=[{"reason": x.reason, "ops": x.ops, "first": x.first, "last": x.last, "bytes": x.nbytes,
                           "runs": [list(r) for r in x.runs], "runs_in_all": x.nruns}
                          for x in s["left_out"]])


def _state(s: dict[str, Any]) -> str:
    """How the recording of a rank ended: read to the end, or why not."""
    if not s["complete"]:
        return f"TRUNCATED after op {s['truncated_after']}"
    if s["missing_ops"]:
        return "DAMAGED: " + "; ".join(describe_missing(s["missing_ops"], most=3)) + \
            "; replay judges the other ops and lists these, other verbs refuse the trace"
    if s["bytes_missing"]:
        return (f"DAMAGED: {_human(s['bytes_missing'])} of its op and data files are missing or cut short since it "
                f"was written (copied in part?); replay refuses it, naming the file")
    if s["stopped"]:
        return f"STOPPED part-way: {s['stopped']}"
    if any(x.reason == LEFT_OUT_BUDGET for x in s["left_out"]):
        return "budget reached"
    return "complete"


def _render_summary(path: str, summaries: list[dict], out: TextIO) -> None:
    total = sum(s["bytes_on_disk"] for s in summaries)
    planted = [s["planted"] for s in summaries if s.get("planted")]
    if planted:  # the first line of every report on such a trace
        out.write("PLANTED FAULT (record --plant): " + "; ".join(planted) + "\n")
    out.write(f"trace {path}: {len(summaries)} rank(s), {sum(s['ops'] for s in summaries)} ops, "
              f"{_human(total)} on disk\n")
    for s in summaries:
        state = _state(s)
        phases = ", ".join(f"{k} {v}" for k, v in sorted(s["phases"].items()))
        out.write(f"\nrank {s['rank']}: {s['ops']} ops ({state}; tensors={s['tensors']}; "
                  f"{_human(s['bytes_on_disk'])})\n  phases: {phases}\n  most frequent of {s['distinct_ops']} "
                  f"distinct ops:\n")
        for name, n in s["most_frequent"]:
            out.write(f"    {n:>6}  {name}\n")
        if s["budget"]:
            out.write(f"  budget: {_human(s['budget'])} (record --budget)\n")
        for x in s["left_out"]:
            out.write(f"  LEFT OUT: {x.describe()}\n")
        for lost in s["lost"]:
            out.write(f"  LOST: {lost}\n")
        for c in s["compiled"]:
            units = " as compiled units" if c.units else ""
            out.write(f"  COMPILED: {c.region} ran {c.how}{units} ({c.calls} call(s))\n")
    env = summaries[0]["environment"] if summaries else Environment()
    out.write(f"\nenvironment (rank {summaries[0]['rank'] if summaries else 0}): torch {env.torch}, "
              f"cuda {env.cuda}, cudnn {env.cudnn}, nccl {env.nccl}, "
              f"host {env.hostname}, world size {env.world_size}, threads {env.num_threads}\n")
    for d in env.devices:
        out.write(f"  device {d.index}: {d.name} (capability {list(d.capability)})\n")
    out.write("  flags: " + ", ".join(f"{k}={v}" for k, v in env.flags.recorded) + "\n")
    variables = env.variables
    if variables:
        out.write("  variables: " + ", ".join(f"{k}={v}" for k, v in variables.items()) + "\n")


def _op_brief(op: OpRecord | None) -> str:
    if op is None:
        return "none"
    where = "  ".join(x for x in (op.module or "", f"({op.phase})" if op.phase else "", op.source or "") if x)
    return f"#{op.index} {op.name}  {where}".rstrip()


def hang_report(trace: Trace) -> tuple[list[GroupArrival], list[RankProgress]]:
    """Per process group, who entered its first call not every rank completed; per rank, where it stopped."""
    return arrivals(trace), [progress(trace.rank(r)) for r in trace.ranks]


def render_hang(groups: list[GroupArrival], ranks: list[RankProgress], out: TextIO) -> None:
    """The "who didn't arrive" section: printed when a rank is inside a collective or the ranks' collectives
    disagree (a hang, a rank that skipped a collective, a job killed mid-step)."""
    if not groups and not any(p.entered is not None for p in ranks):
        return
    out.write("\ncollectives not completed by every rank:\n")
    for g in groups:
        waiting = "".join(f"; rank {r} waiting in op #{i}" for r, i in sorted(g.waiting.items()))
        out.write(f"  group {g.group_name} ranks {list(g.ranks)}: collective #{g.call} of the group ({g.op}): "
                  f"entered by ranks {g.entered}, never by ranks {g.never}{waiting}\n")
        if g.not_in_trace:
            out.write(f"    ranks {g.not_in_trace} of the group have no trace here\n")
    for p in ranks:
        state = "recording finished" if p.complete else "recording cut short"
        inside = f"; inside collective op #{p.entered.index} {p.entered.name}" if p.entered is not None else ""
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
    return s


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
    return json.dumps(value_plain(v))


def value_plain(v: Any) -> Any:
    from replaydiff.trace.schema import value_json

    return value_json(v)


def render_op(r: RankTrace, op: OpRecord, out: TextIO) -> None:
    if r.planted is not None:
        out.write(f"PLANTED FAULT (record --plant): {r.planted.describe()}\n")
    out.write(f"op #{op.index} {op.name}  rank {r.rank}\n")
    if not op.recorded:
        out.write(f"  not recorded: {op.not_recorded_reason}\n")
    out.write(f"  phase   {op.phase}\n  module  {op.module}\n  source  {op.source}"
              f"{'  ' + op.source_text if op.source_text else ''}\n")
    source_line = r.source_line(op)  # the recorded text above is what ran; say if the file here is another one
    if source_line is not None and source_line.warning():
        out.write(f"          {source_line.warning()}\n")
    if op.schema:
        out.write(f"  schema  {op.schema}\n")
    if op.forward_index is not None:
        fwd = r[op.forward_index]
        out.write(f"  forward op #{fwd.index} {fwd.name} ({fwd.source})\n")
    if op.rng is not None:
        out.write(f"  random: generator state recorded ({op.rng.device})\n")
    unit = op.unit
    if unit is not None:  # a compiled unit: its graph's nodes and the backend's kernels
        calls = unit.calls()
        out.write(f"  unit    {unit.kind} graph {unit.graph_id} of {unit.region}, compiled by {unit.backend}: "
                  f"{len(calls)} nodes, {len(unit.kernels)} kernels\n")
        if unit.note:
            out.write(f"          {unit.note}\n")
        if unit.kernels:
            out.write(f"  kernels {', '.join(unit.kernels)}\n")
        for n in calls:
            out.write(f"    {n.name} = {n.target}{'  in ' + n.module if n.module else ''}\n")
    c = op.collective
    if c is not None:
        out.write(f"  collective: group {c.group_name} ranks {list(c.ranks)} (size {c.size}, this rank "
                  f"{c.group_rank}), reduce {c.reduce_op}, root {c.root}\n")
    if not op.recorded:
        return
    ins = _Positions(r.producers(op.index))
    out.write("  arguments:\n")
    for i, a in enumerate(op.args):
        out.write(f"    [{i}] {_value_text(a, ins, True)}\n")
    for k, v in op.kwargs.items():
        out.write(f"    {k}= {_value_text(v, ins, True)}\n")
    for path, after in op.writes:
        out.write(f"  writes {path.kind} {path.key}, after: {_value_text(after, None, False)}\n")
    outs = _Positions(r.consumers(op.index))
    out.write(f"  outputs{' (uninitialised)' if op.uninitialised else ''}:\n")
    values = op.outputs if isinstance(op.outputs, list) else [op.outputs]
    for i, o in enumerate(values):
        out.write(f"    [{i}] {_value_text(o, outs, False)}\n")


def op_json(r: RankTrace, op: OpRecord) -> dict:
    """``show --op N --json``: the typed record with its graph edges (schema replaydiff.op/1)."""
    d = {"format": OP_JSON_FORMAT, **op.to_json()}
    if op.recorded:
        d["producers"] = {str(k): v for k, v in r.producers(op.index).items()}
        d["consumers"] = {str(k): v for k, v in r.consumers(op.index).items()}
    return d


def run(args: argparse.Namespace) -> int:
    trace = open_trace(args.trace)
    if args.list:
        return run_list(trace, args)
    check_no_list_filters(args)
    if args.op is not None:
        r = trace.rank(args.rank if args.rank is not None else trace.ranks[0])
        number = op_number(args.op)
        if not 0 <= number < len(r):
            raise UsageError(f"rank {r.rank} has no op #{number} (last is #{r.last_index})")
        op = r[number]
        if args.json:
            sys.stdout.write(json.dumps(op_json(r, op), indent=1) + "\n")
        else:
            render_op(r, op, sys.stdout)
        return 0
    readers = [trace.rank(args.rank)] if args.rank is not None else list(trace)
    summaries = [rank_summary(r, args.top) for r in readers]
    for s in summaries:
        if not s["complete"]:
            sys.stderr.write(f"replaydiff: warning: rank {s['rank']} is truncated after op {s['truncated_after']} "
                             f"(the recording did not finish)\n")
    groups, ranks = hang_report(trace)
    if args.json:
        progress_json = [{"rank": p.rank, "complete": p.complete,
                          "last_op": None if p.last_op is None else p.last_op.index,
                          "entered": None if p.entered is None else {"index": p.entered.index,
                                                                    "op": p.entered.name}} for p in ranks]
        sys.stdout.write(json.dumps({"format": SUMMARY_FORMAT, "trace": args.trace, "ranks": [_summary_json(s) for s in summaries],
                                     "collectives": [g.to_json() for g in groups], "progress": progress_json},
                                    indent=1) + "\n")
    else:
        _render_summary(args.trace, summaries, sys.stdout)
        render_hang(groups, ranks, sys.stdout)
    # a damaged trace is never described as whole: its state line says so, and so does the exit code (a trace cut
    # short by its job says TRUNCATED or STOPPED and is described as it is, as a hung job's must be)
    damaged = any(s["missing_ops"] or s["bytes_missing"] for s in summaries)
    return EXIT_TRACE if damaged else EXIT_OK


# -- show --list: one line per op, read from the index alone ---------------------------------------------------------

OP_LIST_FORMAT = "replaydiff.oplist/1"


def add_list_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--list", action="store_true",
                   help="list ops one per line: number, op, module, phase, first output (from the index: fast on "
                        "any trace); the numbers are what --op, repro and replay --from take")
    p.add_argument("--module", metavar="GLOB",
                   help="with --list: only ops in modules whose path matches GLOB, e.g. '*.blocks.1.*'")
    p.add_argument("--phase", choices=PHASES, help="with --list: only ops of this phase")
    p.add_argument("--from", dest="first", type=int, metavar="N", help="with --list: from op N on")
    p.add_argument("--to", dest="last", type=int, metavar="M", help="with --list: up to op M (inclusive)")


def op_number(text: str) -> int:
    """``--op N`` without --list: an op number."""
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--op {text} is not an op number; to list ops by name: show --list --op GLOB") from None


def check_no_list_filters(args: argparse.Namespace) -> None:
    given = [flag for flag, v in (("--module", args.module), ("--phase", args.phase), ("--from", args.first),
                                  ("--to", args.last)) if v is not None]
    if given:
        raise UsageError(f"{given[0]} filters --list: show --list {given[0]} ...")


def list_rows(index: TraceIndex, op_glob: str | None = None, module_glob: str | None = None,
              phase: str | None = None, first: int | None = None, last: int | None = None) -> list[int]:
    """The numbers of the ops that pass the filters, in order; reads the index's columns, never an op chunk."""
    check_op_range(first, last, len(index))
    lo, hi = first or 0, len(index) if last is None else min(last + 1, len(index))
    # whole column slices: one list per column instead of a Python call per cell (100k rows filtered in ~0.05 s)
    names, modules, phases = index.name[lo:hi], index.module[lo:hi], index.phase[lo:hi]
    ops, mods = ([op_glob] if op_glob else None), ([module_glob] if module_glob else None)
    return [lo + k for k in range(hi - lo)
            if (phase is None or phases[k] == phase) and matches_any(names[k], ops)
            and (mods is None or matches_any(modules[k], mods))]


def run_list(trace: Trace, args: argparse.Namespace) -> int:
    r = trace.rank(args.rank if args.rank is not None else trace.ranks[0])
    if args.rank is None and len(trace.ranks) > 1:
        sys.stderr.write(f"replaydiff: listing rank {r.rank} of ranks {trace.ranks} (--rank R for another)\n")
    idx = r.index
    rows = list_rows(idx, args.op, args.module, args.phase, args.first, args.last)
    gone = {i: m for m in r.missing_ops for i in range(m.first, m.last + 1)}  # ops whose records are gone
    if args.json:
        doc = {"format": OP_LIST_FORMAT, "trace": args.trace, "rank": r.rank,
               "ops": [{"index": i, "op": idx.name[i], "module": idx.module[i], "phase": idx.phase[i],
                        "output": idx.output[i], "recorded": idx.recorded[i],
                        "missing": _missing_cell(gone[i]) if i in gone else None} for i in rows]}
        sys.stdout.write(json.dumps(doc) + "\n")  # compact: a list can hold 100,000 ops
    else:
        render_list(idx, rows, sys.stdout, gone)
    if not rows:
        sys.stderr.write(f"replaydiff: no op of rank {r.rank} passes these filters\n")
    if r.missing_ops:  # a damaged trace is never listed as whole
        for line in describe_missing(r.missing_ops):
            sys.stderr.write(f"replaydiff: rank {r.rank} is damaged: {line}\n")
        return EXIT_TRACE
    others = [o for o in trace if o.rank != r.rank and (o.missing_ops or o.bytes_missing)]
    for o in others:  # another rank's damage, said though this one lists whole
        sys.stderr.write(f"replaydiff: rank {o.rank} is damaged (`replaydiff show {args.trace} --list --rank "
                         f"{o.rank}` marks its missing ops)\n")
    return EXIT_TRACE if others or r.bytes_missing else 0


def _missing_cell(m: MissingOps) -> str:
    """The last column of a missing op's row: 'missing: ops file F (deleted or never copied)'."""
    return f"missing: ops file {m.path} ({m.problem})" if m.file_known else f"missing: {m.problem}"


def render_list(idx: TraceIndex, rows: list[int], out: TextIO, gone: dict[int, MissingOps] | None = None) -> None:
    """Columns: number, op, module ('-': none), phase, first output ('not recorded' for an op a filter left out;
    'missing: ops file F' for an op whose record is gone from a damaged trace, ``gone``)."""
    if not rows:
        return
    lo, hi = rows[0], rows[-1] + 1
    names, modules, phases = idx.name[lo:hi], idx.module[lo:hi], idx.phase[lo:hi]
    outputs, recorded = idx.output[lo:hi], idx.recorded[lo:hi]
    ks = [i - lo for i in rows]
    w_num = len(str(rows[-1]))
    w_name = max(len(names[k]) for k in ks)
    w_mod = max(len(modules[k] or "-") for k in ks)
    w_phase = max(len(phases[k] or "-") for k in ks)
    gone = gone or {}

    def last(k: int) -> str:
        if lo + k in gone:
            return _missing_cell(gone[lo + k])
        return (outputs[k] or "-") if recorded[k] else "not recorded"

    out.writelines(f"{lo + k:>{w_num}}  {names[k]:<{w_name}}  {modules[k] or '-':<{w_mod}}  "
                   f"{phases[k] or '-':<{w_phase}}  {last(k)}\n" for k in ks)
