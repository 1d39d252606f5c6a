"""What a replay produces: one OpResult per op, gathered in a ReplayReport."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("ok", "divergent", "nondeterministic", "skipped", "error")


@dataclass
class OpResult:
    rank: int
    index: int
    op: str
    status: str
    module: str | None = None
    phase: str | None = None
    source: str | None = None
    forward_index: int | None = None
    forward_source: str | None = None  # for a backward op: the source line of the forward op it belongs to
    metrics: dict[str, Any] | None = None
    reason: str | None = None
    nonfinite_origin: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ReplayReport:
    trace: str
    options: dict[str, Any]
    ops: list[OpResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        c = {s: 0 for s in STATUSES}
        for r in self.ops:
            c[r.status] = c.get(r.status, 0) + 1
        return c

    @property
    def first_divergent(self) -> OpResult | None:
        return next((r for r in self.ops if r.status == "divergent"), None)

    @property
    def first_nondeterministic(self) -> OpResult | None:
        return next((r for r in self.ops if r.status == "nondeterministic"), None)

    @property
    def nonfinite_origin(self) -> OpResult | None:
        return next((r for r in self.ops if r.nonfinite_origin), None)

    @property
    def found_problem(self) -> bool:
        return any(r.status in ("divergent", "nondeterministic") for r in self.ops)
