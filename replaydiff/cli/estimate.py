"""``replaydiff record --estimate``: run the step with ``--tensors meta`` and print what ``--tensors full`` would
write, per rank, module and phase, how long writing it would take here, and which flags fit ``--budget``.

The meta trace goes to a temporary directory and is removed; nothing is written to ``-o``. The write rate is
measured first: 64 MiB written and synced to disk in the directory ``-o`` names (or its nearest existing parent).
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, TextIO

from replaydiff.errors import UsageError
from replaydiff.record.budget import format_size, records_reserve
from replaydiff.record.estimate import RankEstimate, estimate_rank, measure_write_rate, module_globs
from replaydiff.record.options import RecordOptions
from replaydiff.trace import open_trace

ROWS = 15  # (module, phase) rows listed per rank, largest first
FITS = 8  # module selections listed as fitting a budget


def run_estimate(args: argparse.Namespace, cmd: list[str], options: RecordOptions, run_recorded: Callable) -> int:
    """``run_recorded`` is cli/record.py's: runs the command with the step hook armed (record imports this module)."""
    if options.flight or options.granularity != "op":
        raise UsageError("--estimate estimates a --tensors full recording of every op: drop --flight/--granularity")
    probe_dir = Path(args.out).resolve()
    while not probe_dir.is_dir():
        probe_dir = probe_dir.parent
    try:
        rate = measure_write_rate(probe_dir)
    except OSError as exc:
        rate = None
        sys.stderr.write(f"replaydiff: the write rate could not be measured in {probe_dir}: {exc}\n")
    meta = dataclasses.replace(options, tensors="meta", modules=None, ops=None, budget=None, plant=None,
                               max_tensor_bytes=None)
    tmp = Path(tempfile.mkdtemp(prefix="replaydiff-estimate-"))
    try:
        code, _, _ = run_recorded(cmd, tmp, args.step, meta)
        ranks = sorted(p for p in tmp.iterdir() if p.is_dir() and p.name.startswith("rank"))
        if not ranks:
            sys.stderr.write(f"replaydiff: nothing was recorded (the command exited with code {code}), so there is "
                             f"nothing to estimate\n")
            return code or 2
        estimates = [estimate_rank(rt, options.max_tensor_bytes) for rt in open_trace(tmp)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours: made above
    what = f"steps {options.steps}" if options.steps else f"step {args.step}"
    render(estimates, what, rate, probe_dir, options, sys.stdout)
    return code


def render(estimates: list[RankEstimate], what: str, rate: float | None, where: Path, options: RecordOptions,
           out: TextIO) -> None:
    out.write(f"estimate of `record --tensors full` for {what}, from a --tensors meta run (raw bytes: zstd saves "
              f"8-20% of float data)\n")
    if rate is not None:
        out.write(f"write rate here: {rate / 1e6:.0f} MB/s (64 MiB written and synced to disk in {where})\n")
    total = 0
    for est in estimates:
        nbytes = est.data_bytes + est.records_bytes
        total += nbytes
        secs = f", about {_secs(nbytes / rate)} of writing" if rate else ""
        out.write(f"\nrank {est.rank}: {len(est.ops)} ops; full would write {_mb(nbytes)} ({_mb(est.data_bytes)} "
                  f"tensor data, {_mb(est.records_bytes)} op records){secs}\n")
        rows = sorted(est.by_place.items(), key=lambda kv: -kv[1][1])
        width = max([len(m) for (m, _), _ in rows[:ROWS]] + [6])
        out.write(f"  {'module':<{width}}  {'phase':<9}  {'ops':>6}  {'bytes':>10}\n")
        for (module, phase), (n, b) in rows[:ROWS]:
            out.write(f"  {module:<{width}}  {phase:<9}  {n:>6}  {_mb(b):>10}\n")
        if len(rows) > ROWS:
            rest = rows[ROWS:]
            out.write(f"  {f'({len(rest)} more)':<{width}}  {'':<9}  {sum(r[1][0] for r in rest):>6}  "
                      f"{_mb(sum(r[1][1] for r in rest)):>10}\n")
        if options.modules or options.ops:
            sel = est.stored(options.modules, options.ops) + est.records_bytes
            out.write(f"  with your --module/--op: {_mb(sel)}\n")
        if options.budget:
            _fits(est, options.budget, out)
    if len(estimates) > 1:
        out.write(f"\nall {len(estimates)} ranks: {_mb(total)}" + (f", about {_secs(total / rate)} of writing on one "
                                                                  f"disk" if rate else "") +
                  "; --ranks R,... records only those ranks (a --budget is per rank)\n")


def _fits(est: RankEstimate, budget: int, out: TextIO) -> None:
    b = format_size(budget)
    if budget <= records_reserve(budget):
        out.write(f"  --budget {b}: no tensor data would be stored: {format_size(records_reserve(budget))} is kept for "
                  f"op records and statistics (statistics for every op)\n")
        return
    stop, stored = est.budget_stop(budget)
    if stop is None:
        out.write(f"  --budget {b}: everything fits ({_mb(est.data_bytes + est.records_bytes)})\n")
        return
    share = stored / est.data_bytes if est.data_bytes else 1.0
    out.write(f"  --budget {b}: in step order, tensor data stops at about op #{stop} ({share:.0%} of it stored), "
              f"statistics for the rest\n")
    fitting = []
    for module in est.module_subtrees():
        globs = module_globs(module)
        n = est.stored(globs) + est.records_bytes
        if n <= budget - records_reserve(budget):
            fitting.append((n, module, globs))
    # the largest selections that fit whole are the useful ones; nested modules of one that fits fit too
    fitting.sort(key=lambda f: -f[0])
    if not fitting:
        out.write(f"  no module fits {b} whole: record fewer steps, or use --budget {b} with --module for the part "
                  f"to check first\n")
        return
    out.write(f"  fit {b} whole (with statistics for every other op):\n")
    for n, module, globs in fitting[:FITS]:
        out.write(f"    {_mb(n):>10}  " + " ".join(f"--module '{g}'" for g in globs) + "\n")


def _secs(s: float) -> str:
    return f"{s:.2g} s" if s < 60 else f"{s / 60:.1f} min"


def _mb(n: float) -> str:
    return f"{n / 1e6:.3g} MB" if n >= 1e5 else f"{n / 1e3:.3g} KB"
