"""Write a standalone repro of one op: replaydiff repro TRACE OP_INDEX [--rank N] -o DIR

DIR/repro.py needs only torch and safetensors (no replaydiff, no trace): it rebuilds the op's recorded inputs (views,
dtypes, conj/neg bits, generator state) from DIR/repro.json and DIR/inputs.safetensors, runs the op on --device
and at float64 on the CPU, and prints the error of the recorded output and of the device run in the replay report's units. Hand DIR to
the kernel's owner.
"""
from __future__ import annotations

import argparse
import sys

from replaydiff.errors import ExitCode, UsageError, warn
from replaydiff.rebuild_and_judge import shown
from replaydiff.trace import open_trace

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
    from replaydiff.repro.write import rank_damage, repro_op

    trace = open_trace(args.trace)
    for line in rank_damage(trace, args.rank):
        warn(f"the trace is damaged: {line}")
    done = repro_op(trace, args.op, args.out, rank=args.rank, force=args.force, source_trace=args.trace)
    if done.planted is not None:
        sys.stdout.write(f"PLANTED FAULT (record --plant): {done.planted}\n")
    files = done.files
    sys.stdout.write(f"wrote {files.script}, {files.data} and {files.inputs} ({files.nbytes} bytes of tensor data). "
                     f"Run:\n"
                     f"  python {files.script} [--device cuda]\n")
    if done.custom_module is not None:
        sys.stdout.write(f"{shown(done.op_name)} is a custom op: the trace says module {shown(done.custom_module)} "
                         f"defines it; repro.py imports nothing a trace names, so pass --import MODULE (the module "
                         f"is then run: only one you trust)\n")
    return ExitCode.OK
