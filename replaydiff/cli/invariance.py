"""Which op makes a row's result depend on the rest of the batch: each op of a full trace that reads the step's
batch is run again on a slice of it (one row, the first half) at its recorded dtypes on the recording backend, and
compared bit for bit with the same rows of its recorded output.

replaydiff invariance trace/ [--batch-size B] [--json FILE|-]
replaydiff invariance small/ --rows-of big/    # small: the same step on some of big's rows
The batch is followed from the step's inputs through views, reshapes, transposes and attention's head splits. Ops
that do not read it (parameters, optimizer state) are counted, not judged. A batch-variant op is said with its
difference (elements, ULPs, rel_l2), the step's outputs it flows into, and per kind of op what to do.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from replaydiff.cli.flags import add_rank_arg, ranks_of
from replaydiff.cli.progress import progress_bar, write_json
from replaydiff.errors import ExitCode, UsageError
from replaydiff.invariance import Finding, NoBatch, check_invariance, recorded_device
from replaydiff.replay.engine import check_device, check_replayable
from replaydiff.invariance.rows import diff_rows
from replaydiff.report.invariance import render_rows_text, render_text, rows_to_json, to_json
from replaydiff.trace import open_trace

NAME = "invariance"
HELP = "name the ops whose result for a row depends on the rest of the batch"
EXIT_CODES = {ExitCode.OK: "every op that reads the batch is batch-invariant",
              ExitCode.DIVERGENT: "a batch-variant op found, an op that reads the batch could not be judged, or no "
                                  "op that reads it was judged; with "
                                  "--rows-of: the rows differ",
              ExitCode.USAGE: "usage: a trace of --tensors stats or meta, no batch to read, a batch of one row"}


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace directory recorded with --tensors full (the default)")
    p.add_argument("--batch-size", type=int, metavar="B",
                   help="the step's batch size (default: the first dimension of what the model's first op reads, or "
                        "of the forward's first input that no op made and that needs no gradient)")
    p.add_argument("--device", metavar="DEV", help="device to run the ops on (default: the one recorded on)")
    add_rank_arg(p, "rank to check (default: the first)")
    p.add_argument("--rows-of", metavar="BIG",
                   help="TRACE is the same step on some rows of BIG's batch (bs=1 against bs=8): map it onto those "
                        "rows and name the first op where they part, and why")
    p.add_argument("--json", metavar="FILE|-", help="write JSON (format replaydiff.invariance/1) to FILE, or - for stdout")


def run(args: argparse.Namespace) -> int:
    if args.batch_size is not None and args.batch_size < 2:
        raise UsageError("--batch-size must be at least 2 (a batch of one row has no smaller slice)")
    t = open_trace(args.trace)
    t.check_whole()
    ranks = ranks_of(args) or t.ranks[:1]
    if len(ranks) != 1 or ranks[0] not in t.ranks:
        raise UsageError(f"--rank takes one rank of the trace ({', '.join(map(str, t.ranks))})")
    rt = t.rank(ranks[0])
    check_replayable(rt, args.trace)
    if args.rows_of is not None:
        return _rows_of(args, rt)
    check_device(args.device or recorded_device(rt))
    try:
        with progress_bar("checking") as (set_total, advance):
            if set_total is not None:
                set_total(len(rt))
            result = check_invariance(rt, args.batch_size, args.device,
                                      None if advance is None else (lambda done, total: advance(1)))
    except NoBatch as exc:
        raise UsageError(f"{args.trace}: {exc}") from None
    if args.json != "-":
        render_text(result, sys.stdout, trace=args.trace)
    if args.json:
        write_json(args.json, to_json(result, args.trace))
    bad = result.count(Finding.VARIANT) or result.count(Finding.NOT_JUDGED) or result.none_judged
    return ExitCode.DIVERGENT if bad else ExitCode.OK


def _rows_of(args: argparse.Namespace, small: Any) -> int:
    """``--rows-of BIG``: ``small`` (the RankTrace of TRACE) mapped onto its rows of BIG."""
    big_trace = open_trace(args.rows_of)
    big_trace.check_whole()
    big = big_trace.rank(big_trace.ranks[0] if small.rank not in big_trace.ranks else small.rank)
    check_replayable(big, args.rows_of)
    check_device(args.device or recorded_device(big))
    try:
        d = diff_rows(big, small, args.device)
    except NoBatch as exc:
        raise UsageError(str(exc)) from None
    if args.json != "-":
        render_rows_text(d, sys.stdout, big=args.rows_of, small=args.trace)
    if args.json:
        write_json(args.json, rows_to_json(d, args.rows_of, args.trace))
    return ExitCode.DIVERGENT if d.first_difference is not None else ExitCode.OK
