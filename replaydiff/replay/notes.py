"""What replay says about one op beside its status and verdict: typed notes, and the ``Judgement`` that holds them.

Judging an op (``runner``) or checking a collective across ranks (``collectives``) returns a ``Judgement``, a value;
the op's ``OpResult`` is built from it in one place, where ``compare.notes.render`` writes its notes as the reason
line the text and JSON reports show. Each note below is one kind of sentence, written once.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from replaydiff.compare.notes import Fact, Note, VerdictReason, render, verdict_reason
from replaydiff.compare.verdict import Verdict
from replaydiff.rebuild_and_judge import Precision
from replaydiff.replay.result import Status

__all__ = ["CheckFailed", "ChunksDiffer", "CollectiveDiffers", "CollectiveOk", "Failed", "FellBack", "Judgement",
           "LeftOut", "MissedCall", "Note", "RanksMissing", "RecordsMissing", "ReplayFact", "RepeatsDisagree",
           "Skipped", "TraceEndsBefore", "UnitDivergent", "UnitDraws", "UnitWithin", "VerdictReason", "render",
           "verdict_reason"]


class ReplayFact(Fact, Enum):
    """A note that is one fixed sentence."""

    SCALAR_EXACT = "scalar result compared exactly"
    NOTHING_TO_COMPARE = "nothing to compare (views of inputs are checked by shape and stride only)"
    REGISTERED_REFERENCE = "replayed against the reference registered for it (replaydiff.register_reference)"
    DECOMPOSITION = "replayed through its torch._decomp decomposition"
    DECOMPOSITION_DECLINED = "replayed through its own kernel: its torch._decomp decomposition does not cover these " \
                             "arguments (returned NotImplemented)"
    COLLECTIVE = "collective: cannot run alone; checked across ranks when all its ranks are in the trace"
    GROUP_UNKNOWN = "collective: its process group is unknown, so it cannot be checked"
    MISMATCHED_ORDER = "collective: the ranks of its group called different collectives here (mismatched order)"
    EVERY_CHUNK_OK = "collective checked across ranks: every chunk vs what its peer sent"

@dataclass(frozen=True)
class Skipped(Note):
    """Why the op was not replayed (a ``runner.Skip`` or ``collectives.NotChecked`` message)."""

    why: str

    def text(self) -> str:
        return self.why


@dataclass(frozen=True)
class Failed(Note):
    """The op raised: the exception's type and the first line of its message."""

    error: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> "Failed":
        return cls(type(exc).__name__, (str(exc).strip().splitlines() or [""])[0])

    def text(self) -> str:
        return f"{self.error}: {self.message}"[:300]


@dataclass(frozen=True)
class UnitDivergent(Note):
    """A compiled unit's output over its limits, and where inside the unit it was localised (replay/unit_replay.py)."""

    unit: str  # "unit of REGION (graph G, BACKEND)", with any outputs not compared
    output: int
    reason: str  # the verdict's reason
    localised: str  # the earliest divergent node, or why none was named

    def text(self) -> str:
        return f"{self.unit}: output {self.output} {self.reason}; {self.localised}"


@dataclass(frozen=True)
class UnitWithin(Note):
    """A compiled unit whose compared outputs are all within their limits (none: nothing to compare)."""

    unit: str
    outputs: int
    explanation: str | None = None  # why an output over the fixed limits is still ok

    def text(self) -> str:
        if not self.outputs:
            return f"{self.unit}: nothing to compare"
        return f"{self.unit}: {self.outputs} output(s) within limits" + (
            f" ({self.explanation})" if self.explanation else "")


@dataclass(frozen=True)
class UnitDraws(Note):
    """How a compiled unit's outputs that depend on random draws inside it were compared (replay/unit_replay.py): draws
    recovered from recorded outputs are checked by statistics and the outputs after them judged with them; the
    rest are not compared."""

    recovered: tuple[str, ...]  # one sentence per recovered draw: which node, from which output, what was checked
    not_compared: int  # outputs that still depend on a draw no recorded output holds
    nodes: tuple[str, ...]  # the random nodes behind those

    def text(self) -> str:
        parts = []
        if self.recovered:
            parts.append("random draws inside the unit compared by statistics (" + "; ".join(self.recovered)
                         + "), the outputs computed from them judged with the recorded draws")
        if self.not_compared:
            parts.append(f"{self.not_compared} output(s) not compared: they depend on random node(s) "
                         f"{', '.join(self.nodes)}, drawn by the backend's own generator, which replay cannot draw "
                         f"again, and no recorded output holds the draw")
        return "; ".join(parts)


@dataclass(frozen=True)
class LeftOut(Note):
    """Output positions not compared: left unwritten by the kernel, or memory an empty* op handed out."""

    positions: int
    uninitialised: bool  # memory from an empty* op (else: positions the kernel never writes)

    def text(self) -> str:
        if self.uninitialised:
            return (f"{self.positions} output positions that hold uninitialised memory (from an empty* op, not "
                    f"written by this one) were not compared")
        return f"{self.positions} output positions the kernel leaves unwritten were not compared"


@dataclass(frozen=True)
class RepeatsDisagree(Note):
    runs: int

    def text(self) -> str:
        return f"{self.runs} replays of the op disagree with each other"


@dataclass(frozen=True)
class FellBack(Note):
    """The op has no kernel at the precision asked: it was replayed at the next one down."""

    precision: Precision
    asked: Precision
    failure: str  # the first failure at ``asked``

    def text(self) -> str:
        return f"replayed at {self.precision}: at {self.asked} the op failed ({self.failure})"


# -- the cross-rank check of a collective ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RanksMissing(Note):
    ranks: tuple[int, ...]

    def text(self) -> str:
        return f"collective: ranks {list(self.ranks)} of its group are not in the trace"


@dataclass(frozen=True)
class TraceEndsBefore(Note):
    """A crash-cut trace: the call may have happened after the recording of these ranks stopped."""

    ranks: tuple[int, ...]
    call: int

    def text(self) -> str:
        return f"collective: the trace of rank(s) {list(self.ranks)} ends before call {self.call} of this group"


@dataclass(frozen=True)
class RecordsMissing(Note):
    """A damaged trace: collectives of these ranks are missing from some op on, so which call is which is unknown."""

    missing: tuple[str, ...]  # per rank: which ops are missing, and their file

    def text(self) -> str:
        return f"collective: not checked: records of collectives of its group are missing " \
               f"({'; '.join(self.missing)}), so which call on each rank is this one is unknown"


@dataclass(frozen=True)
class MissedCall(Note):
    ranks: tuple[int, ...]
    call: int

    def text(self) -> str:
        return f"collective: rank(s) {list(self.ranks)} of its group never made call {self.call} of this group"


@dataclass(frozen=True)
class CollectiveOk(Note):
    what: str  # what was compared, e.g. "output vs rank 0's input"

    def text(self) -> str:
        return f"collective checked across ranks: {self.what}"


@dataclass(frozen=True)
class CollectiveDiffers(Note):
    what: str
    reason: str | None  # the verdict's

    def text(self) -> str:
        return f"collective: {self.what} ({self.reason})"


@dataclass(frozen=True)
class ChunksDiffer(Note):
    """All-to-all: the chunks received from ``peers`` are not what they sent; the first one's figures."""

    peers: tuple[int, ...]
    peer: int
    what: str
    reason: str | None

    def text(self) -> str:
        return (f"collective: the chunk(s) received from rank(s) {list(self.peers)} differ from what they sent "
                f"(rank {self.peer}: {self.what}; {self.reason})")


@dataclass(frozen=True)
class CheckFailed(Note):
    """The cross-rank check itself raised."""

    error: str
    message: str

    def text(self) -> str:
        return f"cross-rank check failed: {self.error}: {self.message}"


@dataclass(frozen=True)
class Judgement:
    """What judging one op found: the value an ``OpResult`` is built from."""

    status: Status
    verdict: Verdict | None = None
    notes: tuple[Note, ...] = ()
    repeats_disagree: bool = False  # with --repeat N: the runs disagreed (whatever the status)
    collective: bool = False  # a collective, left to the cross-rank check
    unjudged: bool = False  # skipped, though it computed something replay could not check (see runner.Skip)

    @property
    def reason(self) -> str | None:
        return render(self.notes)
