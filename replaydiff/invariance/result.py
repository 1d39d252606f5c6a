"""The frozen result of a batch-invariance check: one ``OpCheck`` per op, a summary per kind of op."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from replaydiff.invariance.advice import Advice


class Finding(Enum):
    """What the check found for one op."""

    VARIANT = "variant"  # a slice of the batch gives other bits than the same slice of the recorded output
    INVARIANT = "invariant"  # every slice gives the recorded bits
    VIEW = "view"  # views of its inputs, or made from their shape alone (empty_like): no arithmetic on the batch
    MEAN = "mean"  # a slice's result is the recorded one times B/rows, bit-near: a mean's divisor (a loss's gradient)
    REDUCES = "reduces"  # it reads the batch but no output keeps it (a loss, a weight gradient): no slice to compare
    NO_BATCH = "no_batch"  # no input carries the batch (parameters, optimizer state, constants): not judged
    NOT_JUDGED = "not_judged"  # it carries the batch but could not be checked; the reason says why

    @property
    def words(self) -> str:
        return self.value.replace("_", " ")

    @property
    def judged(self) -> bool:
        return self in (Finding.VARIANT, Finding.INVARIANT)


@dataclass(frozen=True)
class Rows:
    """A slice of the batch: rows ``start`` to ``stop`` (exclusive)."""

    start: int
    stop: int

    def __str__(self) -> str:
        return f"row {self.start}" if self.stop == self.start + 1 else f"rows {self.start}-{self.stop - 1}"


@dataclass(frozen=True)
class SliceDiff:
    """One output of one op run on a slice of the batch, against the same slice of its recorded output."""

    rows: Rows
    output: str  # "output 0", "arg 0 (written)"
    mismatches: int  # elements whose bits differ
    elements: int
    max_ulps: int  # the largest distance in units in the last place of the recorded dtype
    rel_l2: float  # |slice run - recorded slice|_2 / |recorded slice|_2
    max_abs: float


@dataclass(frozen=True)
class StepOutput:
    """An op whose output ends its phase (nothing later in the phase reads it): the loss or the logits of the
    forward, a gradient of the backward."""

    index: int
    op: str
    module: str | None


@dataclass(frozen=True)
class OpCheck:
    index: int
    op: str
    module: str | None
    phase: str | None
    source: str | None
    finding: Finding
    reason: str | None = None  # why not judged, or how the batch was read
    diffs: tuple[SliceDiff, ...] = ()  # the outputs of the slices that differ (VARIANT only)
    reaches: tuple[StepOutput, ...] = ()  # the step's outputs its result flows into (VARIANT only)

    @property
    def worst(self) -> SliceDiff | None:
        return max(self.diffs, key=lambda d: (d.max_ulps, d.mismatches), default=None)  # the most ULPs apart


@dataclass(frozen=True)
class KindSummary:
    """One kind of op (its name): how many calls were judged invariant and how many not, what to do, where."""

    op: str
    invariant: int
    variant: int
    advice: Advice | None  # for a kind with a variant call
    first: tuple[OpCheck, ...]  # its first few variant calls


@dataclass(frozen=True)
class InvarianceResult:
    rank: int
    batch_size: int
    batch_input: str  # how the batch was found: "op #1 aten.embedding.default argument 1 int64[4, 16], dim 0"
    rows: tuple[Rows, ...]  # the slices checked
    device: str
    threads: int | None  # torch's intra-op threads the ops ran with (the recorded count)
    checks: tuple[OpCheck, ...]
    kinds: tuple[KindSummary, ...]

    @property
    def variant(self) -> tuple[OpCheck, ...]:
        return tuple(c for c in self.checks if c.finding is Finding.VARIANT)

    @property
    def none_judged(self) -> bool:
        """No op that reads the batch was judged (all without it, views, reductions): nothing says it is clean."""
        return not any(c.finding.judged for c in self.checks)

    def count(self, finding: Finding) -> int:
        return sum(1 for c in self.checks if c.finding is finding)
