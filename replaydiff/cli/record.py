"""Record one optimizer step of an unmodified training script: replaydiff record --step 3 -o trace/ -- python train.py

The child runs with replaydiff's step hook armed (also under torchrun: one rank<N>/ directory per process), its exit
code is passed through (a non-zero one is said on the last line, since it may be one of replaydiff's own
codes), and the next commands that fit the trace are printed. When the script never reaches the step
asked for (or no process has a rank of --rank), nothing is recorded: that is said, the empty directory made for the
trace is removed, and the exit code is 2 (a usage error: the request named a step or rank the job does not have;
1 would claim a divergence) unless the script itself failed, whose code is passed through. A step begun after the
script's last one (``--step 6`` of a 5-step script) was never reached either: what the recorder wrote of the script's
tail is removed. A range partly reached (``--steps 4-6``) names the steps recorded and those never reached, exit 0.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from replaydiff.cli.estimate import run_estimate
from replaydiff.cli.flags import add_op_arg, add_rank_arg, ranks_of
from replaydiff.errors import ExitCode, UsageError
from replaydiff.record.options import COMPILED_MODES, GRANULARITIES, TENSOR_MODES, RecordOptions
from replaydiff.record.outcome import record_command, run_recorded
from replaydiff.report.record import render_text

NAME = "record"
HELP = "record the N-th optimizer step of a training command (or many steps: --steps, --flight)"
EXIT_CODES = {  # record is a wrapper: it exits with the command's own code
    ExitCode.OK: "recorded, and the command exited 0",
    ExitCode.DIVERGENT: "not record's own: any non-zero code is the command's, passed through (said on the last line)",
    ExitCode.USAGE: "usage; or nothing was recorded though the command succeeded (a step or rank the job does not "
                    "have)",
}


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--out", default="trace", help="trace directory to write (default: trace)")
    p.add_argument("--step", type=int, default=1, action=_Given,
                   help="which optimizer step to record, from 1 (default 1; with several optimizers, the steps of "
                        "the first one to step)")
    p.add_argument("--tensors", choices=TENSOR_MODES, default=None,
                   help="full: tensor data (default; stats with --granularity module); stats: per-tensor statistics; "
                        "meta: shapes and dtypes only")
    p.add_argument("--no-compress", action="store_true", help="store raw bytes instead of zstd")
    p.add_argument("--module", dest="modules", action="append", metavar="GLOB",
                   help="tensor data only for ops inside these modules (the others: statistics)")
    add_op_arg(p, "tensor data only for ops whose name matches (the others: statistics)")
    p.add_argument("--max-tensor-bytes", type=int, metavar="N", help="store statistics for storages larger than N")
    p.add_argument("--budget", metavar="SIZE",
                   help="bytes each rank's trace may take, e.g. 500M, 2G: tensor data in step order (with --module/"
                        "--op, those ops first) while it fits, statistics for every op")
    p.add_argument("--verify-writes", action="store_true",
                   help="checksum stored CPU tensors to notice writes torch never sees (numpy, C extensions)")
    add_rank_arg(p, "record only this rank of a multi-process job (repeatable, or R,R,...; the others run untouched)",
                 old="--ranks")
    p.add_argument("--plant", metavar="OP[:N[:REL]]",
                   help="plant a fault to check that replay finds it: the N-th call (from 1) of OP returns its output "
                        "times 1+REL (default N=1, REL=1e-3), e.g. aten.mm.default:2; the trace says so")
    p.add_argument("--steps", metavar="A-B[:EVERY]",
                   help="record these optimizer steps into one trace, e.g. 100-2000:10 (each op gets its step)")
    p.add_argument("--granularity", choices=GRANULARITIES, default="op",
                   help="op: every aten op (default); module: statistics of each module's outputs and gradients "
                        "(much cheaper; --tensors stats)")
    p.add_argument("--compiled", choices=COMPILED_MODES, default="capture",
                   help="torch.compile regions: capture (default) runs them compiled and records each compiled graph "
                        "call as one unit; eager runs them as eager aten ops, each recorded")
    p.add_argument("--flight", type=int, metavar="K",
                   help="keep the last K steps in memory; write them when a gradient or the loss turns NaN/Inf, "
                        "on SIGTERM/SIGUSR1, or when the script raises")
    p.add_argument("--flight-mib", type=float, default=64.0, metavar="MIB",
                   help="memory the flight recorder may hold, encoded (default 64)")
    p.add_argument("--flight-at-exit", action="store_true", help="also write the last K steps at a normal exit")
    p.add_argument("--estimate", action="store_true",
                   help="run the step with --tensors meta and print what --tensors full would write per rank, "
                        "module and phase, the time writing it takes here, and (with --budget) the flags that fit; "
                        "nothing is written to -o")
    p.add_argument("--json", metavar="FILE|-",
                   help="with --estimate: write the estimate as JSON (format replaydiff.estimate/1) to FILE, or - for "
                        "stdout (the job's own output then goes to stderr)")
    p.add_argument("--force", action="store_true",
                   help="replace the trace in -o DIR (a replaydiff trace only: a directory holding anything else, the "
                        "working directory and the home directory are refused)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run, e.g. python train.py")


class _Given(argparse.Action):
    """Stores the value and notes that the option was given (``--step 1`` too), for options whose default is a
    value: --step with --steps or --flight is refused, not ignored."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def options_from_args(args: argparse.Namespace) -> RecordOptions:
    # module granularity records statistics: asked alone, it gets them rather than a refusal of the default "full"
    tensors = args.tensors or ("stats" if args.granularity == "module" else "full")
    return RecordOptions.make(tensors=tensors, compress=not args.no_compress, modules=args.modules,
                              ops=args.ops, max_tensor_bytes=args.max_tensor_bytes, verify_writes=args.verify_writes,
                              plant=args.plant, ranks=ranks_of(args),
                              steps=args.steps, granularity=args.granularity, flight=args.flight,
                              flight_mib=args.flight_mib, flight_at_exit=args.flight_at_exit,
                              budget=getattr(args, "budget", None), compiled=args.compiled)


def _refuse_options_without_separator(args: argparse.Namespace, cmd: list[str]) -> None:
    """A command given without ``--`` that holds one of record's own options (``python train.py --steps 5``): it
    goes to the command, though it reads as replaydiff's. Refused: ``--`` says where replaydiff's options end."""
    parser = getattr(args, "verb_parser", None)
    ours = set(getattr(parser, "_option_string_actions", {}))
    clash = next((a for a in cmd if a.split("=", 1)[0] in ours), None)
    if clash is not None:
        raise UsageError(f"{clash.split('=', 1)[0]} comes after the command, so it would go to the command, not to "
                         f"replaydiff: put -- before the command (replaydiff record [options] -- {' '.join(cmd[:2])} "
                         f"...)")


def run(args: argparse.Namespace) -> int:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    else:
        _refuse_options_without_separator(args, cmd)
    if not cmd:
        raise UsageError("no command to record: replaydiff record [options] -- python train.py ARGS")
    if getattr(args, "step_given", False) and (args.steps or args.flight):
        raise UsageError(f"--step {args.step} records one step, --{'steps' if args.steps else 'flight'} chooses "
                         f"the steps itself: give one of them")
    if args.step < 1:
        raise UsageError("--step counts from 1")
    try:
        options = options_from_args(args)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if getattr(args, "json", None) and not getattr(args, "estimate", False):
        raise UsageError("--json writes the estimate: record --estimate --json FILE|- -- COMMAND")
    if getattr(args, "estimate", False):  # a meta run into a temporary directory: -o is left alone
        return run_estimate(args, cmd, options, run_recorded)
    outcome = record_command(cmd, Path(args.out).resolve(), args.out, args.step, options, force=args.force)
    render_text(outcome, sys.stderr, args.out, getattr(args, "budget", None))
    return outcome.exit_code
