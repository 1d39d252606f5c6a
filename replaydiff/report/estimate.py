"""Rendering ``record --estimate`` (``replaydiff.record.estimate.Estimate``): the text table per rank, module and
phase, and the ``replaydiff.estimate/1`` JSON document."""
from __future__ import annotations

from typing import TextIO

from replaydiff.record.budget import format_size, records_reserve
from replaydiff.record.estimate import BudgetFit, Estimate, RankEstimate

FORMAT = "replaydiff.estimate/1"
ROWS = 15  # (module, phase) rows listed per rank in the text, largest first (the JSON has them all)
RAW = "raw bytes: zstd saves 8-20% of float data"


def to_json(e: Estimate) -> dict:
    """The ``replaydiff.estimate/1`` document: what render_text prints, in bytes and seconds."""
    rate, fits = e.rate, e.fits
    ranks = []
    for est in e.ranks:
        nbytes = est.data_bytes + est.records_bytes
        row: dict = {"rank": est.rank, "ops": len(est.ops), "bytes": nbytes, "data_bytes": est.data_bytes,
                     "records_bytes": est.records_bytes, "write_seconds": rate.seconds(nbytes),
                     "places": [{"module": m, "phase": ph, "ops": n, "bytes": b} for (m, ph), (n, b) in _rows(est)]}
        if est.rank in e.selection:
            row["selection"] = {"modules": e.modules, "ops": e.ops, "bytes": e.selection[est.rank]}
        if est.rank in fits:
            f = fits[est.rank]
            row["budget"] = {"fits": f.fits, "no_room": f.no_room, "data_stops_at_op": f.stop,
                             "data_stored": f.stored,
                             "fitting_modules": [{"module": m.module, "bytes": m.nbytes, "flags": m.flags}
                                                 for m in f.modules]}
        ranks.append(row)
    total = sum(r["bytes"] for r in ranks)
    doc: dict = {"format": FORMAT, "what": e.what, "bytes_are": RAW,
                 "write_rate": {"bytes_per_s": rate.bytes_per_s, "measured": rate.how, "error": rate.error},
                 "ranks": ranks,
                 "total": {"ranks": len(ranks), "bytes": total, "write_seconds": rate.seconds(total)},
                 "budget": None}
    if e.budget:
        doc["budget"] = {"bytes": e.budget, "per": "rank", "reserve": records_reserve(e.budget),
                         "ranks_that_fit": e.ranks_that_fit, "flags": e.rank_flags}
    return doc


def render_text(e: Estimate, out: TextIO) -> None:
    rate, fits, estimates = e.rate, e.fits, e.ranks
    out.write(f"estimate of `record --tensors full` for {e.what}, from a --tensors meta run ({RAW})\n")
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
        if est.rank in e.selection:
            out.write(f"  with your --module/--op: {_mb(e.selection[est.rank])}\n")
        if est.rank in fits:
            _fits(est, fits[est.rank], out)
    if len(estimates) > 1:
        secs = rate.seconds(total)
        out.write(f"\nall {len(estimates)} ranks: {_mb(total)}" +
                  (f", about {_secs(secs)} of writing on one disk" if secs is not None else "") +
                  "; --rank R,... records only those ranks (a --budget is per rank)\n")
        if e.budget:
            out.write(_ranks_line(e) + "\n")


def _rows(est: RankEstimate) -> list[tuple[tuple[str, str], list[int]]]:
    """(module, phase) -> [ops, bytes], largest first."""
    return sorted(est.by_place.items(), key=lambda kv: -kv[1][1])


def _ranks_line(e: Estimate) -> str:
    b = format_size(e.budget or 0)
    fitting, estimates = e.ranks_that_fit, e.ranks
    if len(fitting) == len(estimates):
        return f"every rank fits --budget {b} whole"
    if not fitting:
        return f"no rank fits --budget {b} whole: each rank's --module selections above fit it, or record fewer steps"
    rest = [e.rank for e in estimates if e.rank not in fitting]
    flags = " ".join(e.rank_flags or [])
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
