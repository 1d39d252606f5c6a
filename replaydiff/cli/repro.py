"""Write a standalone repro of one op: replaydiff repro TRACE OP_INDEX [--rank N] -o DIR

DIR/repro.py needs only torch and safetensors (no replaydiff, no trace): it rebuilds the op's recorded inputs (views,
dtypes, conj/neg bits, generator state) from DIR/repro.json and DIR/inputs.safetensors, runs the op on --device
and at float64 on the CPU, and prints the error of the recorded output and of the device run in the replay report's units. Hand DIR to
the kernel's owner.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from replaydiff.errors import ExitCode, UsageError, warn
from replaydiff.trace import describe_missing, open_trace

NAME = "repro"
HELP = "write a standalone script (torch + safetensors only) that re-runs one recorded op"
EXIT_CODES = {ExitCode.OK: "the repro directory was written", ExitCode.DIVERGENT: "not used by repro"}


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace directory")
    p.add_argument("op", type=int, metavar="OP_INDEX", help="the op's number (as replay and show print it)")
    p.add_argument("--rank", type=int, default=None, help="rank of the op (default: the trace's first rank)")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="directory to write repro.py, repro.json and "
                                                                     "inputs.safetensors into")
    p.add_argument("--force", action="store_true", help="overwrite a repro that `replaydiff repro` wrote in DIR")


def run(args: argparse.Namespace) -> int:
    from replaydiff.report.repro import DATA, INPUTS, SCRIPT, is_repro_file, write_repro

    trace = open_trace(args.trace)
    rank = trace.ranks[0] if args.rank is None else args.rank
    rt = trace.rank(rank)  # UsageError for a rank the trace does not hold
    for line in describe_missing(rt.missing_ops):  # the op asked for reads (or raises, naming its file) below
        warn(f"the trace is damaged: {line}")
    if not 0 <= args.op < len(rt):
        raise UsageError(f"op {args.op} is not in rank {rank} (ops 0..{len(rt) - 1})")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {args.out} is not a directory (a file is there)")
    existing = [p for p in (out / SCRIPT, out / DATA, out / INPUTS) if p.exists()]
    if existing and not args.force:
        raise UsageError(f"{existing[0]} exists; pass --force to overwrite it")
    foreign = [p for p in existing if not is_repro_file(p)]
    if foreign:  # --force replaces a repro, never a user's file that has the same name
        raise UsageError(f"{foreign[0]} was not written by `replaydiff repro`: not overwriting it (move it or "
                         f"choose another -o)")
    files = write_repro(rt, rt[args.op], out, source_trace=args.trace)
    if rt.planted is not None:
        sys.stdout.write(f"PLANTED FAULT (record --plant): {rt.planted.describe()}\n")
    sys.stdout.write(f"wrote {files.script}, {files.data} and {files.inputs} ({files.nbytes} bytes of tensor data). "
                     f"Run:\n"
                     f"  python {files.script} [--device cuda]\n")
    return ExitCode.OK
