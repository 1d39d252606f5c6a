"""One rank's trace seen through the steps compared, its other steps' ops left out."""
from __future__ import annotations

from replaydiff.trace.reader import RankTrace


class StepsOf:
    """One rank's trace seen through the steps compared (``--step N``, or the steps both traces hold): its other
    steps' ops left out, and what they computed entering as from outside the trace (a parameter the previous step's
    optimizer updated is a step input here), as the rank-by-rank diff does. Anything else is the trace's own."""

    def __init__(self, trace: RankTrace, steps: set[int]) -> None:
        self._trace = trace
        self._keep = {op.index for op in trace if op.step in steps}

    def __getattr__(self, name: str):
        return getattr(self._trace, name)

    def __iter__(self):
        return (op for op in self._trace if op.index in self._keep)

    def __len__(self) -> int:
        return len(self._keep)

    def producers(self, i: int) -> dict[int, int | None]:
        return {pos: p if p in self._keep else None for pos, p in self._trace.producers(i).items()}

    def consumers(self, i: int) -> dict[int, list[int]]:
        return {pos: [c for c in cs if c in self._keep] for pos, cs in self._trace.consumers(i).items()}


def steps_of(trace: RankTrace) -> list[int]:
    """The step numbers a rank's ops carry (empty: recorded without step numbers)."""
    return sorted({op.step for op in trace if op.step is not None})


def only_steps(trace: RankTrace, steps: list[int] | None) -> RankTrace:
    """``trace`` restricted to ``steps`` (None, or a trace without step numbers: all of it)."""
    if steps is None or not steps_of(trace):
        return trace
    return StepsOf(trace, set(steps))  # type: ignore[return-value]
