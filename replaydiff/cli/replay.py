"""Replay every op of a trace alone from its recorded inputs and name the earliest divergent op.

Exit code 0 when nothing diverged, 1 when something did (or was nondeterministic), 2 for a usage error (a trace
recorded with --tensors stats or meta, which holds no data to replay; a --from/--to range or --op glob with no op
in it; a --json FILE that cannot be written; a rank the trace does not hold), 3 for an unreadable trace (and for a
damaged one whose ops that are there show no divergence: the missing ops are listed, and for a partial one, whose
recording stopped part-way: where and why are said), 4 when the device is missing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from replaydiff.cli.flags import add_op_arg, add_rank_arg, ranks_of
from replaydiff.cli.tolerance_args import add_tolerance_args, tolerances_from_args
from replaydiff.errors import EXIT_DIVERGENT, EXIT_OK, EXIT_TRACE, ExitCode, UsageError, say, warn
from replaydiff.replay import ReplayOptions, replay_trace
from replaydiff.replay.policy import PRECISIONS

NAME = "replay"
HELP = "replay each op in isolation and name the first divergent one"
# Without a terminal (a batch job's log) a line of progress, with the time left, this often.
_PLAIN_PROGRESS_SECONDS = 30.0
EXIT_CODES = {
    ExitCode.OK: "every op judged and none diverged",
    ExitCode.DIVERGENT: "not clean: an op divergent or nondeterministic, replicas that part, an op that could not be "
                        "replayed, ops whose data the recording left out (--budget, a full disk) or that computed but "
                        "cannot be replayed, ops missing or a recording stopped part-way, or no op judged at all",
    ExitCode.USAGE: "usage: a trace of --tensors stats or meta (no data to replay), a --from/--to range or --op glob "
                    "with no op in it, a --json FILE that cannot be written, a rank the trace does not hold",
    ExitCode.TRACE: "unreadable; or damaged or partial and the ops that are there show no divergence (the missing "
                    "ops are listed, where and why a recording stopped is said)",
    ExitCode.ENVIRONMENT: "the device asked for is missing",
}


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace directory written by `replaydiff record`")
    p.add_argument("--device", default="cpu", help="reference device: cpu or cuda[:N] (default cpu)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp64",
                   help="fp64 (default): upcast floating data; fp32; same: recorded dtypes, bit for bit on the "
                        "recording backend")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run each op N times; ops whose runs disagree are reported nondeterministic")
    add_op_arg(p, "replay only ops whose name matches (repeatable)", old="--ops")
    p.add_argument("--from", dest="first", type=int, metavar="N",
                   help="first op number to replay (`replaydiff show TRACE --list` lists them)")
    p.add_argument("--to", dest="last", type=int, metavar="M", help="last op number to replay")
    add_rank_arg(p, "replay only this rank (repeatable, or R,R,...)")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="replay with N processes (same report)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="CPU intra-op threads per process (default: the recorded count at --precision same on the "
                        "CPU, which makes it bitwise; else 1); another count tests whether an op depends on the "
                        "parallel split")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first: it registers custom ops of the trace (repeatable)")
    p.add_argument("--reference", choices=("kernel", "decomp"), default="kernel",
                   help="kernel (default): each op's own kernel at the reference precision; decomp: aten ops with a "
                        "torch._decomp decomposition run through it, which catches a wrong fused kernel even when "
                        "the reference device runs the same kernel")
    p.add_argument("--reference-module", dest="reference_modules", action="append", default=[], metavar="MODULE",
                   help="import MODULE first: it registers references for custom ops with "
                        "replaydiff.register_reference(op_name, fn) (repeatable)")
    p.add_argument("--resume", action="store_true",
                   help="keep the results an interrupted replay of this trace with the same options had judged and "
                        "replay only the rest (the report is the same as one whole run's); they are in a journal "
                        "file in $XDG_CACHE_HOME/replaydiff/journals, else ~/.cache/replaydiff/journals, or in "
                        "--journal DIR")
    p.add_argument("--journal", metavar="DIR",
                   help="folder for the journal of judged ops that --resume reads (default: "
                        "$XDG_CACHE_HOME/replaydiff/journals, else ~/.cache/replaydiff/journals); a finished replay "
                        "removes its journal")
    add_tolerance_args(p)
    p.add_argument("--json", metavar="FILE|-", help="write the replaydiff.replay/1 JSON report ('-' for stdout)")


def options_from_args(args: argparse.Namespace) -> ReplayOptions:
    """The options, checked by their type (as from Python); --workers is the engine's, checked here."""
    if args.workers < 1:
        raise UsageError("--workers must be at least 1")
    tol = tolerances_from_args(args)
    try:
        return ReplayOptions(device=args.device, precision=args.precision, repeat=args.repeat, ops=args.ops,
                             first=args.first, last=args.last, ranks=ranks_of(args), tolerances=tol,
                             threads=args.threads, imports=args.imports, reference=args.reference,
                             reference_modules=args.reference_modules)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from replaydiff.cli.progress import progress_bar, write_json
    from replaydiff.report import render_replay, report_to_json
    from replaydiff.report import entry as entry_report
    from replaydiff.trend.entry import entry_of_replay

    from replaydiff.replay.distributed import launched_by_torchrun, replay_sharded
    from replaydiff.replay.engine import keep_freed_memory

    opts = options_from_args(args)
    keep_freed_memory()  # this process is replay's own
    if launched_by_torchrun():  # one of K processes: each replays its share, process 0 writes the report
        if args.workers != 1:
            raise UsageError("--workers and torchrun do not mix: torchrun's processes are the workers")
        if args.resume:
            raise UsageError("--resume needs the journal of one replaying process (with --workers if you like), "
                             "not torchrun's")
        with progress_bar("replaying") as (set_total, advance):
            report = replay_sharded(args.trace, opts, set_total, advance)
        if report is None:
            return EXIT_OK
    else:
        from replaydiff.replay.journal import default_dir

        def resumed(count: int, path: Path) -> None:
            say(f"resuming: {count} op(s) judged by an earlier run kept ({path})" if count else
                f"nothing to resume ({path} holds no results of this replay): replaying every op")

        journal: list[Path] = []  # the journal's file, once the replay has opened it
        try:
            with progress_bar("replaying", plain_every=_PLAIN_PROGRESS_SECONDS) as (set_total, advance):
                report = replay_trace(args.trace, opts, workers=args.workers, progress_total=set_total,
                                      progress=advance, journal=args.journal or default_dir(), resume=args.resume,
                                      on_resumed=resumed, on_journal=journal.append)
        except KeyboardInterrupt:
            if journal and journal[0].exists():  # a replay that judged no op leaves no journal
                say(f"the ops judged so far are kept in {journal[0]}: the same command with --resume replays "
                    f"only the rest (a finished replay removes that file)")
            else:
                say("no op was judged yet: there is nothing for --resume to keep")
            raise
    for w in report.warnings:
        warn(w)
    finding = entry_of_replay(args.trace, report, opts)  # where a difference comes into a clean trace
    entry = finding.entry
    if args.json:
        doc = report_to_json(report)
        doc["enters"] = entry_report.to_json(finding)
        write_json(args.json, doc)
    if args.json != "-":
        nf = report.nonfinite_entry
        # the NaN/Inf line is left out where the entry line names the same input of the same op, unless it names
        # an earlier op than the entry line can (the first whose recorded outputs hold them, not the one that
        # handed them over)
        same_entry = entry is not None and nf is not None and nf.nonfinite_input is not None and \
            nf.nonfinite_input.argument is None and \
            (nf.rank, nf.index, nf.nonfinite_input.position) == (entry.rank, entry.index, entry.position) and \
            nf.nonfinite_input.earliest in (None, nf.nonfinite_input.producer)
        render_replay(report, sys.stdout, entry_said=same_entry)
        origin = report.nonfinite_origin
        # NaN/Inf the entry line would trace to an input, where replay named the op that made them before it: that
        # op is the answer, and the later input only carries what it made
        carried = entry is not None and origin is not None and entry.statistic in ("nan", "inf") and \
            origin.rank == entry.rank and origin.index < entry.index
        if not carried:
            entry_report.render_text(finding, sys.stdout)
    if (report.missing or report.cut_short) and report.first_divergent is None:
        return EXIT_TRACE  # judged what was there; the rest of the trace is gone or never recorded (listed)
    return EXIT_DIVERGENT if report.found_problem else EXIT_OK
