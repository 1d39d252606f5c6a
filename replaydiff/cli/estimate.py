"""``replaydiff record --estimate``: run the step with ``--tensors meta`` and print what ``--tensors full`` would
write, per rank, module and phase, how long writing it would take here, and which flags fit ``--budget``
(``--module`` selections per rank; under torchrun, the ``--rank`` that fit it whole). ``--json FILE|-`` writes the
same as a ``replaydiff.estimate/1`` document.

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
from typing import Callable

from replaydiff.cli.progress import write_json
from replaydiff.errors import ExitCode, UsageError, say
from replaydiff.record.estimate import WriteRate, build_estimate, estimate_trace, measure_write_rate
from replaydiff.record.options import RecordOptions
from replaydiff.report.estimate import render_text, to_json


def run_estimate(args: argparse.Namespace, cmd: list[str], options: RecordOptions, run_recorded: Callable) -> int:
    """``run_recorded`` is cli/record.py's: runs the command with the step hook armed (record imports this module).
    With ``--json -`` the job's own stdout goes to stderr, so stdout is the document alone."""
    if options.flight or options.granularity != "op":
        raise UsageError("--estimate estimates a --tensors full recording of every op: drop --flight/--granularity")
    dest = getattr(args, "json", None)
    probe_dir = Path(args.out).resolve()
    while not probe_dir.is_dir():
        probe_dir = probe_dir.parent
    try:
        rate = WriteRate(measure_write_rate(probe_dir), probe_dir)
    except OSError as exc:
        rate = WriteRate(None, probe_dir, str(exc))
        say(f"the write rate could not be measured in {probe_dir}: {exc}")
    meta = dataclasses.replace(options, tensors="meta", modules=None, ops=None, budget=None, plant=None,
                               max_tensor_bytes=None)
    tmp = Path(tempfile.mkdtemp(prefix="replaydiff-estimate-"))
    try:
        code, _, _ = run_recorded(cmd, tmp, args.step, meta, stdout=2 if dest == "-" else None)
        ranks = sorted(p for p in tmp.iterdir() if p.is_dir() and p.name.startswith("rank"))
        if not ranks:
            say(f"nothing was recorded (the command exited with code {code}), so there is nothing to estimate")
            return code or ExitCode.USAGE
        estimates = estimate_trace(tmp, options.max_tensor_bytes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours: made above
    what = f"steps {options.steps}" if options.steps else f"step {args.step}"
    estimate = build_estimate(estimates, what, rate, options.modules, options.ops, options.budget)
    if dest:
        write_json(dest, to_json(estimate))
    if dest != "-":
        render_text(estimate, sys.stdout)
    return code
