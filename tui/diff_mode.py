"""Provides diff_results: a trace diff's pairs as per-op rows (RowResult) of the target trace, for diff mode.

Headless (no textual). ``replaydiff tui TARGET --diff REF`` colours TARGET's rows by the diff of REF against it
instead of by a replay: each aligned pair becomes one row on its target op number, with the pair's status as the
row's status (``divergent`` walks with f/n/N like a divergent replay; ``inherited`` only carried an earlier
difference forward), and ops present in the target only get a row of their own.
"""
from __future__ import annotations

from typing import Any

from replaydiff.diff.result import PairStatus
from replaydiff.replay.result import Status
from replaydiff.tui.model import RowResult, RowStatus

# a pair's status -> its row's (a same pair reads as ok, one not compared as skipped, as in a replay)
ROW_STATUS: dict[PairStatus, RowStatus] = {PairStatus.SAME: Status.OK, PairStatus.DIVERGENT: Status.DIVERGENT,
                                           PairStatus.INHERITED: PairStatus.INHERITED,
                                           PairStatus.NOT_COMPARED: Status.SKIPPED}


def diff_results(report: Any) -> list[RowResult]:
    """Rows for every target rank the report diffed (the first rank pair per target rank wins: a single-process
    target diffed against several reference ranks shows the lowest)."""
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
    return out
