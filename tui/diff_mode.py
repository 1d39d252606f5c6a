"""Provides diff_results: a trace diff's pairs as per-op rows (RowResult) of the target trace, for diff mode.

Headless (no textual). ``replaydiff tui TARGET --diff REF`` colours TARGET's rows by the diff of REF against it
instead of by a replay: each aligned pair becomes one row on its target op number, with the pair's status as the
row's status (``divergent`` walks with f/n/N like a divergent replay; ``inherited`` only carried an earlier
difference forward), and ops present in the target only get a row of their own. A compiled unit paired with the
eager ops of its region (diff/units.py) gives rows too: the unit's own in the target, or the target's eager ops.
"""
from __future__ import annotations

from typing import Any

from replaydiff.diff.result import PairStatus, UnitPair
from replaydiff.replay.result import Status
from replaydiff.tui.model import RowResult, RowStatus

# a pair's status -> its row's (a same pair reads as ok, one not compared as skipped, as in a replay)
ROW_STATUS: dict[PairStatus, RowStatus] = {PairStatus.SAME: Status.OK, PairStatus.DIVERGENT: Status.DIVERGENT,
                                           PairStatus.INHERITED: PairStatus.INHERITED,
                                           PairStatus.NOT_COMPARED: Status.SKIPPED}


def diff_results(report: Any) -> list[RowResult]:
    """Rows for every target rank the report diffed (the first rank pair per target rank wins: a single-process
    target diffed against several reference ranks shows the lowest)."""
    if getattr(report, "parallel", None) is not None:
        return parallel_rows(report.parallel)
    out: list[RowResult] = []
    seen: set[int] = set()
    for rd in report.ranks:
        if rd.target_rank in seen:
            continue
        seen.add(rd.target_rank)
        for p in rd.pairs:
            out.append(RowResult.of_pair(rd.target_rank, p, ROW_STATUS.get(p.status, Status.SKIPPED), rd.ref_rank))
        for i in sorted(rd.target_only_ops):
            out.append(RowResult.target_only(rd.target_rank, i, rd.ref_rank))
        for u in rd.units:
            out.extend(unit_rows(rd.target_rank, u, rd.ref_rank))
    return out


def unit_rows(rank: int, unit: UnitPair, ref_rank: int) -> list[RowResult]:
    """The target's rows a compiled unit pair covers. A unit in the target: its own row, with the pair's status.
    A unit in the reference: the target's eager op where they part (else the first one) carries the pair's status;
    the region's other eager ops were compared as part of the unit, not one by one (not compared)."""
    status = ROW_STATUS.get(unit.status, Status.SKIPPED)
    if unit.side == "target":
        return [RowResult.of_unit(rank, unit.unit, unit, status, ref_rank)]
    lead = unit_lead(unit)
    return [RowResult.of_unit(rank, i, unit, status, ref_rank) if i == lead else
            RowResult.of_unit(rank, i, unit, Status.SKIPPED, ref_rank, lead=False) for i in unit.eager]


def unit_lead(unit: UnitPair) -> int | None:
    """A unit in the reference: the target's eager op that carries the pair's status (where they part, else the
    region's first); None for a unit in the target."""
    if unit.side == "target" or not unit.eager:
        return None
    return unit.part.eager if unit.part is not None else unit.eager[0]


def parallel_rows(pd: Any) -> list[RowResult]:
    """A parallel run mapped onto the single process: each aligned op's row on every rank, ok when its values fit
    a layout a correct run has, divergent where the runs part, inherited after; the layout is the row's figure."""
    if pd.groups:  # a parallel reference: each of its ranks mapped onto its own ranks of the target
        return [row for g in pd.groups for row in parallel_rows(g)]
    out: list[RowResult] = []
    first = pd.departure.op.ref if pd.departure is not None else None
    for op in pd.ops:
        if not op.tensors:
            continue
        if op.ref == first:
            status, reason = Status.DIVERGENT, pd.departure.why
        elif op.ref in pd.parted:
            status, reason = PairStatus.INHERITED, "parts from the reference after the first op that does"
        else:
            status, reason = Status.OK, None
        for rank, index in op.on_ranks():
            # the figure column holds a number (err/lim): a mapping has none; the detail pane shows each layout
            out.append(RowResult(rank, index, status, None, "", None, reason, False, op, 0))
    return out
