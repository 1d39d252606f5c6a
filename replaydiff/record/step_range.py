"""Which optimizer steps to record: ``"7"``, ``"100-2000"``, ``"100-2000:10"``, ``"100-:10"`` (no end)."""
from __future__ import annotations

import re
from dataclasses import dataclass

_SPEC = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d*)\s*)?(?::\s*(\d+)\s*)?$")


@dataclass(frozen=True)
class StepRange:
    """Steps ``first``, ``first + every``, ... up to ``last`` (None: no end)."""

    first: int
    last: int | None
    every: int = 1

    @classmethod
    def parse(cls, spec: str) -> "StepRange":
        """``"7"``, ``"100-2000"``, ``"100-2000:10"``, ``"100-:10"`` (no end), ``"1-"``; steps count from 1."""
        m = _SPEC.match(str(spec))
        if not m:
            raise ValueError(f"steps {spec!r}: expected N, A-B, A-B:EVERY or A-:EVERY (e.g. 100-2000:10)")
        first = int(m.group(1))
        dash = "-" in str(spec)
        last = first if not dash else (int(m.group(2)) if m.group(2) else None)
        every = int(m.group(3) or 1)
        if first < 1 or every < 1 or (last is not None and last < first):
            raise ValueError(f"steps {spec!r}: steps count from 1, and A <= B, EVERY >= 1")
        return cls(first, last, every)

    def __contains__(self, step: object) -> bool:
        return (isinstance(step, int) and step >= self.first and (self.last is None or step <= self.last)
                and (step - self.first) % self.every == 0)

    def over_after(self, step: int) -> bool:
        """No chosen step comes after ``step``."""
        if self.last is None:
            return False
        last_chosen = self.last - (self.last - self.first) % self.every
        return step >= last_chosen
