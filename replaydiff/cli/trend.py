"""Per-module series of a multi-step statistics trace, and the first sudden change: step, module and op.

replaydiff record --tensors stats --steps 1-2000:10 -o trace/ -- python train.py
replaydiff trend trace/ [--module 'GPT.blocks.*'] [--json -] [--plot trend.svg]
It names the op that made the change (walking back from the first op that shows it) and prints the commands that
record and replay a closer look: the step and the one before it, in full, for that module.
Exit code 1 when a sudden change is found, 0 when none.
"""
from __future__ import annotations

import argparse
import sys

from replaydiff.cli.progress import write_json
from replaydiff.errors import ExitCode, UsageError, say
from replaydiff.report.trend import render_svg, render_text, to_json
from replaydiff.trace import open_trace
from replaydiff.trend import DEFAULT_THRESHOLD, DEFAULT_WINDOW, NoTrend, compute_trend

NAME = "trend"
HELP = "per-module statistics over many steps, and the first sudden change"
EXIT_CODES = {ExitCode.OK: "no sudden change", ExitCode.DIVERGENT: "a sudden change found"}


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace directory recorded with --steps or --flight")
    p.add_argument("--module", metavar="GLOB", help="only modules whose path matches, e.g. '*.h.1.*'")
    p.add_argument("--rank", type=int, default=None, help="rank to read (default: the first)")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"steps before a value it is compared with (default {DEFAULT_WINDOW})")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help=f"robust z-score that counts as a sudden change (default {DEFAULT_THRESHOLD:g})")
    p.add_argument("--json", metavar="FILE|-", help="write JSON (format replaydiff.trend/1) to FILE, or - for stdout")
    p.add_argument("--plot", metavar="FILE.svg", help="draw the output series as SVG")


def run(args: argparse.Namespace) -> int:
    if args.window < 2 or args.threshold <= 0:
        raise UsageError("--window must be >= 2 and --threshold > 0")
    t = open_trace(args.trace)
    t.check_whole()  # a step with ops gone would read as a change: name the missing file instead
    rank = t.ranks[0] if args.rank is None else args.rank
    try:
        trend = compute_trend(t.rank(rank), args.module, args.window, args.threshold)
    except NoTrend as exc:
        raise UsageError(f"{args.trace}: {exc}") from None
    if args.json != "-":
        render_text(trend, sys.stdout, trace=args.trace)
    if args.json:
        write_json(args.json, to_json(trend, args.trace), indent=None)
    if args.plot:
        with open(args.plot, "w") as f:
            render_svg(trend, f)
        say(f"plot written to {args.plot}")
    return ExitCode.DIVERGENT if trend.first_change is not None else ExitCode.OK
