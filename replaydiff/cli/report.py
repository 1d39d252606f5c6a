"""Write a health report of a replayed trace: replaydiff report TRACE --replay RESULT.json [-o report.md|report.html]

A table of checks (what, measured, limit, pass or fail), the culprit with its module, phase and source line, the ten
ops with the largest error over their limit, the error per module, the environment, and likely causes with remedies,
each shown with its evidence from the trace (a cause without evidence is not listed). Markdown on stdout without -o;
``-o FILE.html`` writes one self-contained HTML file with an SVG plot of the error along the op sequence. An existing
file is never overwritten without --force. Exit code 1 when any check FAILs (the replay found a problem), else 0; 2
when RESULT.json is a replay of another trace (one that exists at the path it names); 3 when ops are missing from the
trace (a file deleted or cut short since it was written) or its recording stopped part-way, and the replay named no
divergent op.
"""
from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from replaydiff.errors import ExitCode, UsageError, say, warn

NAME = "report"
HELP = "write a health report (markdown or HTML) from a trace and its replay JSON"
EXIT_CODES = {ExitCode.OK: "every check passes", ExitCode.DIVERGENT: "a check FAILs (the replay found a problem)",
              ExitCode.USAGE: "usage; or RESULT.json is a replay of another trace (one that exists at the path it "
                              "names)",
              ExitCode.TRACE: "unreadable; or ops missing or a recording stopped part-way, and the replay named no "
                              "divergent op"}


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace directory")
    p.add_argument("--replay", required=True, metavar="RESULT.json",
                   help="the report of `replaydiff replay TRACE --json RESULT.json`")
    p.add_argument("-o", "--out", metavar="FILE", help="report.md or report.html (default: markdown on stdout)")
    p.add_argument("--format", choices=("md", "html"), help="the format (default: from the file's suffix)")
    p.add_argument("--no-probe", action="store_true",
                   help="do not re-run the culprit to test causes (its dependence on the CPU thread count)")
    p.add_argument("--force", action="store_true", help="overwrite an existing report file")


def run(args: argparse.Namespace) -> int:
    from replaydiff.health import build_health
    from replaydiff.rebuild_and_judge import shown_lines
    from replaydiff.report.health import render_html, render_markdown
    from replaydiff.replay.result import check_replay_of
    from replaydiff.report.json_report import load_replay_json
    from replaydiff.trace import open_trace

    fmt = args.format or ("html" if args.out and Path(args.out).suffix.lower() in (".html", ".htm") else "md")
    if args.out and Path(args.out).exists() and not args.force:
        raise UsageError(f"{args.out} exists; pass --force to overwrite it")
    report = load_replay_json(args.replay)
    trace = open_trace(args.trace)
    said = check_replay_of(report, trace, args.replay, args.trace)
    if said:
        warn(said)
    health = build_health(trace, report, probe=not args.no_probe)
    buf = io.StringIO()
    (render_html if fmt == "html" else render_markdown)(health, buf)
    if args.out:
        Path(args.out).write_text(shown_lines(buf.getvalue()))  # the file is read on a terminal too: guarded alike
        say(f"wrote {args.out}")
    else:
        sys.stdout.write(buf.getvalue())
    return health.exit_code
