"""Summarise a trace (ranks, ops per phase, most frequent ops, bytes, environment), print one op whole (--op N), or
list its ops one line each (--list, filtered by --op GLOB, --module GLOB, --phase, --from/--to)."""
from __future__ import annotations

import argparse
import sys

from replaydiff.cli.progress import write_json
from replaydiff.errors import EXIT_OK, EXIT_TRACE, ExitCode, UsageError, say, warn
from replaydiff.report.show import (list_to_json, list_warnings, op_to_json, render_list, render_op, render_text,
                                    to_json)
from replaydiff.trace import Trace, open_trace
from replaydiff.trace.schema import PHASES
from replaydiff.trace.summary import op_detail, op_listing, op_number, summarise

NAME = "show"
HELP = "summarise a trace, print one op with --op N, or list ops with --list"
EXIT_CODES = {ExitCode.OK: "summarised, printed or listed", ExitCode.DIVERGENT: "not used by show",
              ExitCode.USAGE: "a usage error, or --list filters that no op passes",
              ExitCode.TRACE: "unreadable, or damaged: ops or bytes missing or failing their checksum (on the rank "
                              "listed or another), or partial: the recording stopped part-way"}


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace directory")
    p.add_argument("--op", metavar="N|GLOB", help="print op N whole; with --list, list only ops whose name matches "
                                                 "GLOB, e.g. 'aten.*mm*'")
    p.add_argument("--rank", type=int, default=None,
                   help="rank to show (default: all for the summary, the first for --op and --list)")
    p.add_argument("--top", type=int, default=10, help="how many of the most frequent ops to list")
    add_list_args(p)
    p.add_argument("--json", nargs="?", const="-", metavar="FILE|-",
                   help="write JSON (replaydiff.show/1, .op/1 or .oplist/1) to FILE, or - for stdout (a bare --json: "
                        "stdout, in place of the text)")


def run(args: argparse.Namespace) -> int:
    trace = open_trace(args.trace)
    if args.list:
        return run_list(trace, args)
    check_no_list_filters(args)
    if args.op is not None:
        detail = op_detail(trace.rank(args.rank if args.rank is not None else trace.ranks[0]), op_number(args.op))
        if args.json:
            write_json(args.json, op_to_json(detail))
        if args.json != "-":
            render_op(detail, sys.stdout)
        return EXIT_OK
    summary = summarise(trace, args.trace, args.rank, args.top)
    for s in summary.ranks:
        if not s.complete:
            warn(f"rank {s.rank} is truncated after op {s.truncated_after} (the recording did not finish)")
        elif s.stopped is not None:
            warn(f"rank {s.rank}'s recording stopped part-way: {s.stopped}")
    if args.json:
        write_json(args.json, to_json(summary))
    if args.json != "-":
        render_text(summary, sys.stdout)
    # a damaged or partial trace is never described as whole: its state line says so (DAMAGED, TRUNCATED, STOPPED),
    # it is described as it is (as a hung job's must be), and the exit code is replay's for it
    return EXIT_TRACE if summary.damaged or summary.partial else EXIT_OK


# -- show --list: one line per op, read from the index alone ---------------------------------------------------------
def add_list_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--list", action="store_true",
                   help="list ops one per line: number, op, module, phase, first output (from the index: fast on "
                        "any trace); the numbers are what --op, repro and replay --from take")
    p.add_argument("--module", metavar="GLOB",
                   help="with --list: only ops in modules whose path matches GLOB, e.g. '*.blocks.1.*'")
    p.add_argument("--phase", choices=PHASES, help="with --list: only ops of this phase")
    p.add_argument("--from", dest="first", type=int, metavar="N", help="with --list: from op N on")
    p.add_argument("--to", dest="last", type=int, metavar="M", help="with --list: up to op M (inclusive)")


def check_no_list_filters(args: argparse.Namespace) -> None:
    given = [flag for flag, v in (("--module", args.module), ("--phase", args.phase), ("--from", args.first),
                                  ("--to", args.last)) if v is not None]
    if given:
        raise UsageError(f"{given[0]} filters --list: show --list {given[0]} ...")


def run_list(trace: Trace, args: argparse.Namespace) -> int:
    rank = args.rank if args.rank is not None else trace.ranks[0]
    if args.rank is None and len(trace.ranks) > 1:
        say(f"listing rank {rank} of ranks {trace.ranks} (--rank R for another)")
    listing = op_listing(trace, args.trace, rank, args.op, args.module, args.phase, args.first, args.last)
    if args.json:
        write_json(args.json, list_to_json(listing), indent=None)  # compact: a list can hold 100,000 ops
    if args.json != "-":
        render_list(listing, sys.stdout)
    list_warnings(listing, sys.stderr)
    # a damaged or partial trace is never listed as whole, nor one with another rank damaged; filters that select
    # nothing are a usage error, as replay's --op that matches no op is
    return EXIT_TRACE if listing.damaged or listing.partial else EXIT_OK if listing.rows else ExitCode.USAGE
