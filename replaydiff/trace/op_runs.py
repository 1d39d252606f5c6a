"""Provides OpRuns and op_runs: a set of op numbers written as its exact runs of consecutive numbers.

"682 ops (#7-#719) not judged" claims every op from #7 to #719 when ops in between were judged; the runs
("#7-#18, #20-#25, #29-#46 and 40 more runs up to #719") never cover a number outside the set. A long list keeps its
first runs and says how many more there are and where the last ends: a count, never a wider range.
"""
from __future__ import annotations

from typing import Iterable

SHOWN = 6  # runs written out before the rest are counted


class OpRuns:
    """Op numbers added in increasing order, kept as their first ``keep`` runs, the number of runs and the last
    number: enough to write them exactly (``describe``) in constant memory, however many ops there are."""

    __slots__ = ("keep", "runs", "count", "last", "ops")

    def __init__(self, keep: int = SHOWN) -> None:
        self.keep = keep
        self.runs: list[list[int]] = []  # [first, last] of the first ``keep`` runs
        self.count = 0  # runs in all
        self.last: int | None = None
        self.ops = 0

    def add(self, index: int) -> None:
        self.ops += 1
        if self.last is not None and index == self.last + 1:
            if self.count == len(self.runs):  # the run being extended is one of those kept
                self.runs[-1][1] = index
        else:
            self.count += 1
            if len(self.runs) < self.keep:
                self.runs.append([index, index])
        self.last = index

    def describe(self) -> str:
        return describe_runs([(a, b) for a, b in self.runs], self.count, self.last)


def describe_runs(runs: list[tuple[int, int]], count: int, last: int | None) -> str:
    """``#a-#b, #c, ...``; when ``count`` (the runs in all) is more than those given, ``and N more runs up to
    #last``. Empty for no runs."""
    text = ", ".join(f"#{a}" if a == b else f"#{a}-#{b}" for a, b in runs)
    more = count - len(runs)
    if more > 0 and runs:
        text += f" and {more} more run{'s' if more > 1 else ''} up to #{last}"
    return text


def op_runs(indices: Iterable[int], shown: int = SHOWN) -> str:
    """The op numbers (any order, repeats ignored) as exact runs: ``#695-#701, #710, #900-#3735``; past ``shown``
    runs, the rest as a count and the last number."""
    runs = OpRuns(shown)
    for i in sorted(set(indices)):
        runs.add(i)
    return runs.describe()
