"""Diff two traces of one step: align their op streams and name, per rank, the first op whose inputs agree and
whose outputs do not.

REF and TARGET may differ in length and order (extra casts, other kernels, autocast on one side, foreach against
for-loop optimizers, another world size); unaligned ops are listed as structural differences. Exit code 0 when the
runs agree, 1 when they part ways, 2 for a usage error, 3 for an unreadable trace, and for a partial one (a side whose
recording stopped part-way: said where and why) where the ops both hold agree.
"""
from __future__ import annotations

import argparse
import sys

from replaydiff.cli.tolerance_args import add_tolerance_args, tolerances_from_args
from replaydiff.errors import EXIT_DIVERGENT, EXIT_OK, EXIT_TRACE, ExitCode, UsageError, warn

NAME = "diff"
HELP = "diff two traces of a step and name the op where the runs part ways"
EXIT_CODES = {ExitCode.OK: "the runs agree", ExitCode.DIVERGENT: "the runs part ways",
              ExitCode.TRACE: "unreadable; or partial (a side whose recording stopped part-way) where the ops both "
                              "hold agree"}


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("ref", help="reference trace directory")
    p.add_argument("target", help="trace directory to compare against the reference")
    p.add_argument("--rank", type=int, metavar="N",
                   help="diff only rank N of the multi-rank side (the target, unless it is a single process)")
    p.add_argument("--step", type=int, metavar="N",
                   help="compare only step N of traces recorded with step numbers (--steps, --step N)")
    p.add_argument("--baseline", metavar="REF2",
                   help="a second reference run: each tensor's limit is widened to the REF-against-REF2 difference "
                        "times --safety where that exceeds the fixed per-dtype limits")
    p.add_argument("--safety", type=float, default=8.0, metavar="F",
                   help="baseline mode: safety factor on the reference runs' own difference (default 8)")
    add_tolerance_args(p)
    p.add_argument("--json", metavar="FILE|-", help="write the replaydiff.diff/1 JSON report ('-' for stdout)")


def run(args: argparse.Namespace) -> int:
    from replaydiff.cli.progress import progress_bar, write_json
    from replaydiff.diff import DiffOptions, diff_traces
    from replaydiff.report.diff_json import diff_to_json
    from replaydiff.report.diff_text import render_diff

    tol = tolerances_from_args(args)
    try:
        opts = DiffOptions(rank=args.rank, tolerances=tol, safety=args.safety, step=args.step)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with progress_bar("diffing") as (set_total, advance):
        report = diff_traces(args.ref, args.target, opts, baseline=args.baseline, progress_total=set_total,
                             progress=advance)
    for w in report.warnings:
        warn(w)
    if args.json:
        write_json(args.json, diff_to_json(report))
    if args.json != "-":
        render_diff(report, sys.stdout)
    if report.found_difference:
        return EXIT_DIVERGENT
    return EXIT_TRACE if report.cut_short else EXIT_OK  # a partial trace is never said to agree
