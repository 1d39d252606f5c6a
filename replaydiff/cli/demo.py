"""Record one step of a built-in tiny transformer with a planted faulty kernel, replay it, and name the culprit.

The fault is a dispatch mode below the recorder that multiplies the output of one backward op
(aten.native_layer_norm_backward, by default) by 1 + 1e-3, the way a buggy kernel would. Every op after it inherits
the error; replay feeds each op its own recorded inputs, so only the planted op diverges. Exit code 0 when the
culprit found is the planted op, 1 otherwise.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from replaydiff.errors import ExitCode

NAME = "demo"
HELP = "record a tiny model step with a planted faulty kernel, replay it, print the culprit"
EXIT_CODES = {ExitCode.OK: "the culprit found is the planted op", ExitCode.DIVERGENT: "it is not"}


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--out", help="keep the trace in this directory (default: a temporary one)")
    p.add_argument("--fault-op", default="aten.native_layer_norm_backward.default",
                   help="op whose output the planted fault perturbs")
    p.add_argument("--occurrence", type=int, default=1, metavar="N",
                   help="which call of that op, from 1 (default 1, the first), as N in record --plant OP:N")
    p.add_argument("--rel", type=float, default=1e-3, help="relative size of the perturbation (default 1e-3)")
    p.add_argument("--workers", type=int, default=1, help="replay with N processes")


def run(args: argparse.Namespace) -> int:
    from replaydiff.cli.progress import progress_bar
    from replaydiff.errors import UsageError
    from replaydiff.faults import PlantedFault
    from replaydiff.models import TinyTransformer, make_step
    from replaydiff.record import record
    from replaydiff.replay import ReplayOptions, replay_trace
    from replaydiff.report import render_replay
    from replaydiff.report.text import op_line

    if args.occurrence < 1:
        raise UsageError("--occurrence counts from 1 (the first call), as N in record --plant OP:N does")
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = make_step(model, model.example_batch(), opt)
    tmp = None
    if args.out:
        out = Path(args.out)
        if out.exists() and any(out.iterdir()):
            raise UsageError(f"{args.out} exists and is not empty")
    else:
        tmp = tempfile.mkdtemp(prefix="replaydiff-demo-")
        out = Path(tmp)
    try:
        fault = PlantedFault(args.fault_op, rel=args.rel, call=args.occurrence)  # from 1, as --plant OP:N
        with fault, record(out):
            loss = step()
        if not fault.planted:
            raise UsageError(f"the step never ran {args.fault_op} (call {args.occurrence}): nothing was planted")
        print(f"recorded one training step of a tiny transformer (loss {loss.item():.4f}) into "
              f"{args.out or 'a temporary directory'}")
        with progress_bar("replaying") as (set_total, advance):
            report = replay_trace(str(out), ReplayOptions(), workers=args.workers, progress_total=set_total,
                                  progress=advance)
        render_replay(report, sys.stdout)
        planted = [r for r in report.ops if r.op == args.fault_op]
        planted_op = planted[args.occurrence - 1] if len(planted) >= args.occurrence else None
        print(f"planted fault:      {op_line(planted_op) if planted_op else args.fault_op} (x(1{args.rel:+g}))")
        culprit = report.first_divergent
        print(f"culprit found:      {op_line(culprit) if culprit else 'none'}")
        hit = culprit is not None and planted_op is not None and culprit.index == planted_op.index
        print("=> replaydiff named the planted op" if hit else "=> replaydiff did NOT name the planted op")
        if tmp:  # the path above is gone once the demo returns
            print(f"(the trace {tmp} was temporary and is deleted now: `replaydiff demo -o DIR` keeps it for show, "
                  f"replay, repro and tui)")
        return ExitCode.OK if hit else ExitCode.DIVERGENT
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
