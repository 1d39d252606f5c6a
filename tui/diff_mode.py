"""Provides DiffResult and diff_results: a trace diff's pairs as per-op rows of the target trace, for diff mode.

Headless (no textual). ``replaydiff tui TARGET --diff REF`` colours TARGET's rows by the diff of REF against it
instead of by a replay: each aligned pair becomes one row result on its target op number, with the pair's status
as the row's status (``divergent`` walks with f/n/N like a divergent replay; ``inherited`` only carried an earlier
difference forward), and ops present in the target only get a row result of their own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replaydiff.diff.result import PairStatus
from replaydiff.replay.result import Status
from replaydiff.tui.model import Presence, RowStatus

# a pair's status -> its row's (a same pair reads as ok, one not compared as skipped, as in a replay)
ROW_STATUS: dict[PairStatus, RowStatus] = {PairStatus.SAME: Status.OK, PairStatus.DIVERGENT: Status.DIVERGENT,
                                           PairStatus.INHERITED: PairStatus.INHERITED,
                                           PairStatus.NOT_COMPARED: Status.SKIPPED}


@dataclass
class DiffResult:
    """One target op's row in diff mode: the OpResult fields the model and the detail pane read, plus the pair."""

    rank: int  # the target rank
    index: int  # the target op number
    status: RowStatus
    ref_rank: int
    pair: Any = None  # PairResult; None for an op present in the target only
    nonfinite_origin: bool = False

    @property
    def verdict(self) -> Any:
        return None if self.pair is None else self.pair.verdict

    @property
    def metrics(self) -> dict | None:
        return None if self.pair is None else self.pair.metrics

    @property
    def severity(self) -> float | None:
        return None if self.pair is None else self.pair.severity

    @property
    def reason(self) -> str | None:
        return None if self.pair is None else self.pair.reason


def diff_results(report: Any) -> list[DiffResult]:
    """Row results for every target rank the report diffed (the first rank pair per target rank wins: a
    single-process target diffed against several reference ranks shows the lowest)."""
    out: list[DiffResult] = []
    seen: set[int] = set()
    for rd in report.ranks:
        if rd.target_rank in seen:
            continue
        seen.add(rd.target_rank)
        for p in rd.pairs:
            out.append(DiffResult(rd.target_rank, p.target, ROW_STATUS.get(p.status, Status.SKIPPED), rd.ref_rank, p))
        for i in sorted(rd.target_only_ops):
            out.append(DiffResult(rd.target_rank, i, Presence.TARGET_ONLY, rd.ref_rank))
    return out
