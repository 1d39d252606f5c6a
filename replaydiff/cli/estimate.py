"""``replaydiff record --estimate``: run the step with ``--tensors meta`` and print what ``--tensors full`` would
write, per rank, module and phase, how long writing it would take here, and which flags fit ``--budget``
(``--module`` selections per rank; under torchrun, the ``--ranks`` that fit it whole). ``--json FILE|-`` writes the
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

from replaydiff.cli.progress import write_json
from replaydiff.errors import UsageError
from replaydiff.record.budget import format_size, records_reserve
from replaydiff.record.estimate import PROBE_BYTES, BudgetFit, RankEstimate, estimate_rank, measure_write_rate, \
    ranks_flags, ranks_that_fit
from replaydiff.record.options import RecordOptions
from replaydiff.trace import open_trace
from replaydiff.trace.modes import TensorMode

FORMAT = "replaydiff.estimate/1"
ROWS = 15  # (module, phase) rows listed per rank in the text, largest first (the JSON has them all)
RAW = "raw bytes: zstd saves 8-20% of float data"


@dataclass
class WriteRate:
    """The disk's write rate where the trace would go, as measured (None, with the error, when it could not be)."""

    bytes_per_s: float | None
    directory: Path
    error: str | None = None

    @property
    def how(self) -> str:
        return f"{PROBE_BYTES >> 20} MiB written and synced to disk in {self.directory}"

    def seconds(self, nbytes: int) -> float | None:
        return nbytes / self.bytes_per_s if self.bytes_per_s else None


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
        sys.stderr.write(f"replaydiff: the write rate could not be measured in {probe_dir}: {exc}\n")
    meta = dataclasses.replace(options, tensors=TensorMode.META, modules=None, ops=None, budget=None, plant=None,
                               max_tensor_bytes=None)
    tmp = Path(tempfile.mkdtemp(prefix="replaydiff-estimate-"))
    try:
        code, _, _ = run_recorded(cmd, tmp, args.step, meta, stdout=2 if dest == "-" else None)
        ranks = sorted(p for p in tmp.iterdir() if p.is_dir() and p.name.startswith("rank"))
        if not ranks:
            sys.stderr.write(f"replaydiff: nothing was recorded (the command exited with code {code}), so there is "
                             f"nothing to estimate\n")
            return code or 2
        estimates = [estimate_rank(rt, options.max_tensor_bytes) for rt in open_trace(tmp)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours: made above
    what = f"steps {options.steps}" if options.steps else f"step {args.step}"
    fits = {e.rank: e.fit(options.budget) for e in estimates} if options.budget else {}
    if dest:
        write_json(dest, estimate_to_json(estimates, fits, what, rate, options))
    if dest != "-":
        render(estimates, fits, what, rate, options, sys.stdout)
    return code


def estimate_to_json(estimates: list[RankEstimate], fits: dict[int, BudgetFit], what: str, rate: WriteRate,
                     options: RecordOptions) -> dict:
    """The ``replaydiff.estimate/1`` document: what render prints, in bytes and seconds."""
    ranks = []
    for est in estimates:
        nbytes = est.data_bytes + est.records_bytes
        row: dict = {"rank": est.rank, "ops": len(est.ops), "bytes": nbytes, "data_bytes": est.data_bytes,
                     "records_bytes": est.records_bytes, "write_seconds": rate.seconds(nbytes),
                     "places": [{"module": m, "phase": ph, "ops": n, "bytes": b} for (m, ph), (n, b) in _rows(est)]}
        if options.modules or options.ops:
            row["selection"] = {"modules": options.modules, "ops": options.ops,
                                "bytes": est.stored(options.modules, options.ops) + est.records_bytes}
        if est.rank in fits:
            f = fits[est.rank]
            row["budget"] = {"fits": f.fits, "no_room": f.no_room, "data_stops_at_op": f.stop,
                             "data_stored": f.stored,
                             "fitting_modules": [{"module": m.module, "bytes": m.nbytes, "flags": m.flags}
                                                 for m in f.modules]}
        ranks.append(row)
    total = sum(r["bytes"] for r in ranks)
    doc: dict = {"format": FORMAT, "what": what, "bytes_are": RAW,
                 "write_rate": {"bytes_per_s": rate.bytes_per_s, "measured": rate.how, "error": rate.error},
                 "ranks": ranks,
                 "total": {"ranks": len(ranks), "bytes": total, "write_seconds": rate.seconds(total)},
                 "budget": None}
    if options.budget:
        budget = options.budget
        fitting = ranks_that_fit(estimates, budget)
        doc["budget"] = {"bytes": budget, "per": "rank", "reserve": records_reserve(budget),
                         "ranks_that_fit": fitting, "flags": _rank_selection(estimates, fitting, budget)}
    return doc


def render(estimates: list[RankEstimate], fits: dict[int, BudgetFit], what: str, rate: WriteRate,
           options: RecordOptions, out: TextIO) -> None:
    out.write(f"estimate of `record --tensors full` for {what}, from a --tensors meta run ({RAW})\n")
    if rate.bytes_per_s is not None:
        out.write(f"write rate here: {rate.bytes_per_s / 1e6:.0f} MB/s ({rate.how})\n")
    total = 0
    for est in estimates:
        nbytes = est.data_bytes + est.records_bytes
        total += nbytes
        secs = rate.seconds(nbytes)
        out.write(f"\nrank {est.rank}: {len(est.ops)} ops; full would write {_mb(nbytes)} ({_mb(est.data_bytes)} "
                  f"tensor data, {_mb(est.records_bytes)} op records)"
                  + (f", about {_secs(secs)} of writing" if secs is not None else "") + "\n")
        rows = _rows(est)
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
        if est.rank in fits:
            _fits(est, fits[est.rank], out)
    if len(estimates) > 1:
        secs = rate.seconds(total)
        out.write(f"\nall {len(estimates)} ranks: {_mb(total)}" +
                  (f", about {_secs(secs)} of writing on one disk" if secs is not None else "") +
                  "; --ranks R,... records only those ranks (a --budget is per rank)\n")
        if options.budget:
            out.write(_ranks_line(estimates, options.budget) + "\n")


def _rows(est: RankEstimate) -> list[tuple[tuple[str, str], list[int]]]:
    """(module, phase) -> [ops, bytes], largest first."""
    return sorted(est.by_place.items(), key=lambda kv: -kv[1][1])


def _rank_selection(estimates: list[RankEstimate], fitting: list[int], budget: int) -> list[str] | None:
    """The flags that fit the budget by ranks: the ranks that fit it whole (just --budget when all do)."""
    if not fitting:
        return None
    return ["--budget", format_size(budget)] if len(fitting) == len(estimates) else ranks_flags(fitting, budget)


def _ranks_line(estimates: list[RankEstimate], budget: int) -> str:
    b = format_size(budget)
    fitting = ranks_that_fit(estimates, budget)
    if len(fitting) == len(estimates):
        return f"every rank fits --budget {b} whole"
    if not fitting:
        return f"no rank fits --budget {b} whole: each rank's --module selections above fit it, or record fewer steps"
    rest = [e.rank for e in estimates if e.rank not in fitting]
    flags = " ".join(ranks_flags(fitting, budget))
    return f"--budget {b} fits {_ranks(fitting)} whole, not {_ranks(rest)}: `record {flags}` records " \
           f"{'it' if len(fitting) == 1 else 'them'} complete"


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def _fits(est: RankEstimate, f: BudgetFit, out: TextIO) -> None:
    b = format_size(f.budget)
    if f.no_room:
        out.write(f"  --budget {b}: no tensor data would be stored: {format_size(f.reserve)} is kept for op records "
                  f"and statistics (statistics for every op)\n")
        return
    if f.fits:
        out.write(f"  --budget {b}: everything fits ({_mb(est.data_bytes + est.records_bytes)})\n")
        return
    share = f.stored / est.data_bytes if est.data_bytes else 1.0
    out.write(f"  --budget {b}: in step order, tensor data stops at about op #{f.stop} ({share:.0%} of it stored), "
              f"statistics for the rest\n")
    if not f.modules:
        out.write(f"  no module fits {b} whole: record fewer steps, or use --budget {b} with --module for the part "
                  f"to check first\n")
        return
    out.write(f"  fit {b} whole (with statistics for every other op):\n")
    for m in f.modules:
        out.write(f"    {_mb(m.nbytes):>10}  " + " ".join(f"--module '{g}'" for g in m.flags[1::2]) + "\n")


def _secs(s: float) -> str:
    return f"{s:.2g} s" if s < 60 else f"{s / 60:.1f} min"


def _mb(n: float) -> str:
    return f"{n / 1e6:.3g} MB" if n >= 1e5 else f"{n / 1e3:.3g} KB"
