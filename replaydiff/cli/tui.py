"""Browse a trace in a terminal UI: op list, module tree, op details, heat strip and op graph, coloured by a replay.

Without --replay, a replay (fp64 on the CPU unless --device/--precision say otherwise) runs in the background and
rows take their colour as results arrive. With --diff REF the rows take their colour from the diff of REF against
the trace (divergent, inherited, same, target-only), computed in the background, and nothing is replayed. Textual
is imported only when this command runs.
"""
from __future__ import annotations

import argparse
import sys

from replaydiff.errors import EXIT_OK, ExitCode, UsageError
from replaydiff.replay.policy import PRECISIONS, ReplayOptions

NAME = "tui"
HELP = "browse a trace and its replay in a terminal UI"
EXIT_CODES = {ExitCode.OK: "the UI was closed", ExitCode.DIVERGENT: "not used by tui"}


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace directory written by `replaydiff record`")
    p.add_argument("--replay", metavar="REPORT.json",
                   help="colour ops from this report (`replaydiff replay --json FILE`) instead of replaying")
    p.add_argument("--diff", metavar="REF",
                   help="colour ops by the diff of reference trace REF against this one (`replaydiff diff REF TRACE`) "
                        "instead of replaying")
    p.add_argument("--invariance", action="store_true",
                   help="colour ops by a batch-invariance check (`replaydiff invariance TRACE`), run before the UI "
                        "opens: batch-variant ops red, invariant ones green, the rest skipped with what it found")
    p.add_argument("--rank", type=int, default=None, help="rank to open first (default: the lowest)")
    p.add_argument("--device", default="cpu", help="reference device for the background replay (default cpu)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp64",
                   help="precision of the background replay (default fp64)")


def run(args: argparse.Namespace) -> int:
    if sum(x is not None and x is not False for x in (args.diff, args.replay, args.invariance)) > 1:
        raise UsageError("--diff, --replay and --invariance each say what colours the rows: give one")
    if args.replay is None and args.diff is None and not args.invariance:
        # a device that is not there is exit 4 here, as for `replay`, not a failure in the UI
        from replaydiff.replay.engine import check_device

        check_device(args.device)
    try:
        from replaydiff.tui.app import make_app
    except ImportError as exc:  # textual missing in a slim install
        raise UsageError(f"the terminal UI needs textual ({exc}); pip install textual") from None

    rows = _invariance_rows(args) if args.invariance else None
    app = make_app(args.trace, rank=args.rank, report_path=args.replay, diff_ref=args.diff,
                   replay=ReplayOptions(device=args.device, precision=args.precision), rows=rows)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        # said after make_app, so that an unreadable trace is still exit 3; run, Textual would write escape codes
        # into the file or pipe until killed
        raise UsageError("tui needs a terminal: its standard input and output must both be one (for a report in a "
                         "file or pipe: replaydiff replay TRACE, or show TRACE --list)")
    app.run()
    return EXIT_OK


def _invariance_rows(args: argparse.Namespace) -> object:
    """The rows of a batch-invariance check of the rank opened (the check runs in this process, before the UI)."""
    from replaydiff.invariance import NoBatch, check_invariance
    from replaydiff.replay.engine import check_replayable
    from replaydiff.trace import open_trace
    from replaydiff.tui.model import invariance_rows

    t = open_trace(args.trace)
    rt = t.rank(t.ranks[0] if args.rank is None else args.rank)
    check_replayable(rt, args.trace)
    try:
        return invariance_rows(check_invariance(rt))
    except NoBatch as exc:
        raise UsageError(f"{args.trace}: {exc}") from None
