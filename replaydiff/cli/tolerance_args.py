"""The --tolerance and --no-scale-reductions options, shared by the verbs that judge tensors (replay, diff)."""
from __future__ import annotations

import argparse

from replaydiff.compare.tolerance import Tolerances
from replaydiff.errors import UsageError


def add_tolerance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tolerance", action="append", metavar="DTYPE=MAX[,REL]",
                   help="override a dtype's limits on max_abs/(eps*absmax) and rel_l2/eps, e.g. float32=32,16 (DTYPE: float64, "
                        "float32, bfloat16, float16 or fp64, fp32, bf16, fp16; repeatable)")
    p.add_argument("--no-scale-reductions", action="store_true",
                   help="do not widen limits by sqrt(K/256) for reductions over K > 256 terms")


def tolerances_from_args(args: argparse.Namespace) -> Tolerances:
    try:
        return Tolerances.parse_overrides(args.tolerance, scale_reductions=not args.no_scale_reductions)
    except ValueError as exc:
        raise UsageError(f"--tolerance: {exc}") from None
