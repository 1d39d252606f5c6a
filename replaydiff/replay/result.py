"""What a replay produces: one OpResult per op (a Status and a Verdict), gathered in a ReplayReport."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from replaydiff.trace.location import OpLocation
from replaydiff.compare.verdict import Verdict
from replaydiff.trace.damage import CutShort, MissingOps
from replaydiff.trace.schema import LEFT_OUT_UNWANTED, LEFT_OUT_WHY, PlantedFaultInfo
from replaydiff.trace.op_runs import op_runs


class Status(str, Enum):
    OK = "ok"
    DIVERGENT = "divergent"
    NONDETERMINISTIC = "nondeterministic"
    SKIPPED = "skipped"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value

    __format__ = lambda self, spec: format(self.value, spec)  # noqa: E731  (f"{status}" -> "ok" on every Python)


STATUSES = tuple(s.value for s in Status)
PROBLEMS = (Status.DIVERGENT, Status.NONDETERMINISTIC)


@dataclass
class NonfiniteInput:
    """An input that already held NaN/Inf when the op read it, and that no replayed op computed: written outside the
    trace (the batch, a parameter, a tensor written outside the dispatcher; ``producer`` None) or by op ``producer``,
    whose tensor data the recording left out; or a NaN/Inf number argument (``argument``). Where NaN/Inf enter a step
    that makes none of its own."""

    position: int  # among the op's tensor inputs, as ``replaydiff show --op`` numbers them
    nan: int
    inf: int
    producer: int | None = None
    producer_op: str | None = None
    # They came in as a number the op was passed ("-inf": masked_fill(mask, -inf)), not in a tensor: ``position`` is
    # that argument's among the op's positional arguments (-1: a keyword argument), and the counts are of the
    # NaN/Inf it put in the op's outputs.
    argument: str | None = None
    # With ``producer``: the earliest op, in the order ops ran, that replay did not run either and whose recorded
    # output holds these NaN/Inf (walked back from ``producer`` through the statistics the recording kept:
    # replay/nonfinite_source.py); its counts, its input that took them in from outside the trace
    # (``earliest_input``), or ``earliest_made``: it made them from inputs that hold none (``earliest_argument``: it
    # was passed them as a number).
    earliest: int | None = None
    earliest_op: str | None = None
    earliest_nan: int = 0
    earliest_inf: int = 0
    earliest_input: int | None = None
    earliest_made: bool = False
    earliest_argument: str | None = None  # it was passed them as a number ("inf": a fill_), its inputs holding none

    def counts(self) -> str:
        return nonfinite_counts(self.nan, self.inf)

    def kinds(self) -> str:
        """'NaN', 'Inf', 'NaN and Inf' or 'Inf and NaN': what enters, those held at the earliest op first (Inf that
        an overflow made and a LayerNorm then turned into NaN: 'Inf and NaN')."""
        order = [("NaN", self.earliest_nan), ("Inf", self.earliest_inf), ("NaN", self.nan), ("Inf", self.inf)]
        return " and ".join(dict.fromkeys(kind for kind, n in order if n)) or "NaN"


def nonfinite_counts(nan: int, inf: int) -> str:
    """e.g. '32 NaN', '1 NaN and 2 Inf' ('' for none)."""
    return " and ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "Inf")) if n)


@dataclass
class OpResult:
    rank: int
    index: int
    op: str
    status: Status
    module: str | None = None
    phase: str | None = None
    source: str | None = None
    forward_index: int | None = None
    location: OpLocation | None = None  # where it is (trace/location.py): what every report says of its place
    verdict: Verdict | None = None  # the deciding output's verdict (the worst one when all are within limits)
    reason: str | None = None
    nonfinite_origin: bool = False
    # The NaN this op made (nonfinite_origin) it made of inputs that hold Inf but no NaN (a softmax over a row of
    # nothing but -inf, inf - inf), not of finite inputs.
    nonfinite_from_inf: bool = False
    # NaN/Inf came into the op through this input from outside what replay computed (see NonfiniteInput).
    nonfinite_input: NonfiniteInput | None = None
    # The NaN/Inf this op made (nonfinite_origin) or let in (nonfinite_input) reach no loss, gradient, parameter or
    # output of the step: every op that reads them makes finite values (these ops; replay/flow.py). None: they do
    # reach one (or the trace cannot tell), or the op made and let in none.
    nonfinite_discarded_by: list[int] | None = None
    # A collective: not run alone, but checked across ranks once every rank's results are in (engine.finish).
    collective: bool = False
    # With --repeat N: the N runs of the op disagreed with each other (also for an op divergent anyway).
    repeats_disagree: bool = False
    # Why the recording left this op's tensor data out (OpRecord.data_left_out): it is skipped, never judged.
    data_left_out: str | None = None
    # Skipped, though it did real computation that replay could not run (a compiled unit without a replayable
    # graph): what it computed is unchecked, so the replay is not clean.
    unjudged: bool = False

    def __post_init__(self) -> None:
        self.status = Status(self.status)

    @property
    def severity(self) -> float | None:
        """How far over its limit the op is, in units of its limit: its verdict's ``severity`` (at most 1 within
        the limits, over 1 divergent). A problem the verdict does not show counts too: a nondeterministic op is at
        its limit at least, a divergent one without figures (ranks of a collective that disagree on its group)
        infinitely far. 0 for an op judged without figures (a view, an equal scalar); None when nothing was
        judged (skipped, error)."""
        v = self.verdict
        if v is None:
            if self.status is Status.OK:
                return 0.0
            return math.inf if self.status in PROBLEMS else None
        s = v.severity
        if self.status is Status.DIVERGENT and s <= 1:
            return math.inf
        if self.status is Status.NONDETERMINISTIC:
            return max(s, 1.0)
        return s

    @property
    def metrics(self) -> dict[str, Any] | None:
        """The verdict's figures as the JSON report writes them."""
        return None if self.verdict is None else self.verdict.to_json()


@dataclass
class ReplayReport:
    trace: str
    options: dict[str, Any]
    ops: list[OpResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # Across ranks (engine.finish): the culprit, the earliest divergent op by collective-synchronised position,
    # and the other ranks' candidates whose order against it no collective decides.
    culprit: tuple[int, int] | None = None
    undecided: list[tuple[int, int]] = field(default_factory=list)
    # Where data-parallel replicas first stop agreeing across ranks (replicas.ReplicaBreak), if they do.
    replicas: Any = None
    # Faults planted while recording (record --plant), one description per rank: every report says so first.
    planted: list[str] = field(default_factory=list)
    # The same faults as read from the trace (where each landed, what it changed): replay.plants says what became
    # of each in this replay.
    plants: list[PlantedFaultInfo] = field(default_factory=list)
    # Ops this replay was asked for whose records are gone from the trace (RankTrace.missing_ops): never judged,
    # so the replay is never clean; the earliest divergent op among the others may not be the culprit.
    missing: list[MissingOps] = field(default_factory=list)
    # Ranks whose recording ended before what it was asked for (RankTrace.cut_short): the trace is partial (what came
    # after was never recorded, the culprit may be there), so the replay is never clean.
    cut_short: list[CutShort] = field(default_factory=list)
    # Trace.fingerprint of the trace replayed: a report or the TUI refuses results of an earlier recording.
    fingerprint: str = ""
    # Recomputes (activation checkpointing) whose outputs are not the forward op's they run again
    # (replay/recomputes.py): a finding of their own, so the replay is not clean.
    recomputes_differ: list[Any] = field(default_factory=list)
    # recomputes whose only difference is state written in place again (BatchNorm's running statistics): information
    recomputes_state: list[Any] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        c = {s.value: 0 for s in Status}
        for r in self.ops:
            c[r.status.value] += 1
        return c

    @property
    def first_divergent(self) -> OpResult | None:
        """The culprit: on one rank its earliest divergent op; across ranks the earliest by collective order."""
        if self.culprit is not None:
            hit = next((r for r in self.ops if (r.rank, r.index) == self.culprit), None)
            if hit is not None:
                return hit
        return next((r for r in self.ops if r.status is Status.DIVERGENT), None)

    @property
    def first_per_rank(self) -> list[OpResult]:
        """Every rank's earliest divergent op, in that rank's own order (one candidate per rank)."""
        seen: dict[int, OpResult] = {}
        for r in self.ops:
            if r.status is Status.DIVERGENT and (r.rank not in seen or r.index < seen[r.rank].index):
                seen[r.rank] = r
        return [seen[k] for k in sorted(seen)]

    @property
    def first_nondeterministic(self) -> OpResult | None:
        return next((r for r in self.ops if r.status is Status.NONDETERMINISTIC), None)

    @property
    def nonfinite_origin(self) -> OpResult | None:
        """The first op that made NaN/Inf from finite inputs, or NaN from inputs holding Inf but no NaN, that reach
        the loss, a gradient, a parameter or an output of the step (made and discarded ones are
        ``nonfinite_discarded``)."""
        return next((r for r in self.ops if r.nonfinite_origin and r.nonfinite_discarded_by is None), None)

    @property
    def nonfinite_discarded(self) -> list[OpResult]:
        """Ops that made NaN/Inf from finite inputs, or let them into the step, that no op keeps: selected away (a
        where, masked_fill, index, an additive -inf mask through softmax). Information, never a fault."""
        return [r for r in self.ops if r.nonfinite_discarded_by is not None
                and (r.nonfinite_origin or r.nonfinite_input is not None)]

    @property
    def nonfinite_entry(self) -> OpResult | None:
        """The first op that read NaN/Inf from outside what replay computed (``OpResult.nonfinite_input``) that reach
        the loss, a gradient, a parameter or an output, when no op made such NaN/Inf from finite inputs before it:
        where they enter the step (None when an origin comes first)."""
        entry = next((r for r in self.ops if r.nonfinite_input is not None and r.nonfinite_discarded_by is None),
                     None)
        origin = self.nonfinite_origin
        if entry is None or (origin is not None and (origin.rank, origin.index) < (entry.rank, entry.index)):
            return None
        return entry

    @property
    def not_judged(self) -> list[OpResult]:
        """Ops the recording meant to store but left the data of out (record --budget, a full disk): not judged, so
        never clean. Ops outside a --module/--op filter are left out on purpose and are not among them."""
        return [r for r in self.ops if r.data_left_out in LEFT_OUT_UNWANTED]

    def left_out_summary(self) -> list[str]:
        """One line per reason the recording left data out against its will (budget, disk full): how many ops, and
        which (their exact runs per rank: judged ops lie between them). Ops outside a filter are the skipped line's
        to count."""
        groups: dict[str, list[OpResult]] = {}
        for r in self.ops:
            if r.data_left_out in LEFT_OUT_UNWANTED:
                groups.setdefault(r.data_left_out, []).append(r)
        lines = []
        for why, ops in groups.items():
            ranks = sorted({r.rank for r in ops})
            if len({r.rank for r in self.ops}) > 1:
                where = "; ".join(f"rank {k} {op_runs(r.index for r in ops if r.rank == k)}" for k in ranks)
            else:
                where = op_runs(r.index for r in ops)
            lines.append(f"{len(ops)} op(s) ({where}) not judged: tensor data left out, "
                         f"{LEFT_OUT_WHY.get(why, why)}")
        return lines

    def missing_before(self, r: OpResult) -> list[MissingOps]:
        """Missing ops of ``r``'s rank numbered before it: an earlier culprit may be among them."""
        return [m for m in self.missing if m.rank == r.rank and m.first < r.index]

    @property
    def unjudged(self) -> list[OpResult]:
        """Ops skipped although they computed something (``OpResult.unjudged``): never clean."""
        return [r for r in self.ops if r.unjudged]

    def unjudged_summary(self) -> list[str]:
        """One line per reason ops were skipped though they computed something: 'not judged  N  #A, #B (OP): WHY'."""
        groups: dict[str, list[OpResult]] = {}
        for r in self.unjudged:
            groups.setdefault(r.reason or "", []).append(r)
        many = len({r.rank for r in self.ops}) > 1
        lines = []
        for why, ops in groups.items():
            which = ", ".join(f"{f'rank {r.rank} ' if many else ''}#{r.index}" for r in ops[:8])
            more = f" and {len(ops) - 8} more" if len(ops) > 8 else ""
            names = ", ".join(sorted({r.op for r in ops}))
            lines.append(f"not judged {len(ops):>3}  {which}{more} ({names}): {why}")
        return lines

    @property
    def nothing_judged(self) -> bool:
        """No op was judged at all (every one skipped: a --module filter that matched nothing, a trace of shapes):
        a replay that checked nothing is not clean."""
        return not any(r.status is not Status.SKIPPED for r in self.ops) and self.replicas is None

    @property
    def found_problem(self) -> bool:
        """Not clean (exit 1): an op divergent or nondeterministic, replicas that part, an op that could not be
        replayed (its result was never judged; the health report fails its check too), one whose data the
        recording left out for its budget or a full disk (never judged either), one skipped though it computed
        something (a compiled unit without a replayable graph), ops missing from a damaged trace, a recording that
        stopped part-way (a partial trace), or no op judged at all."""
        return self.nothing_judged or bool(self.missing or self.cut_short or self.recomputes_differ) or \
            self.replicas is not None or any(
            r.status in PROBLEMS or r.status is Status.ERROR or r.unjudged or
            r.data_left_out in LEFT_OUT_UNWANTED for r in self.ops)


def check_replay_of(report: ReplayReport, trace: Any, replay_file: str, trace_arg: str) -> str | None:
    """Whether ``report`` (read from ``replay_file``) holds results of ``trace`` (opened from ``trace_arg``).

    UsageError when they are another recording's: the trace was recorded again since (its fingerprint differs), or
    the report names another trace that exists here. Returns a warning when only the path differs and the report is
    too old to carry a fingerprint (the trace moved, or replay ran in another folder); None when they match."""
    import os

    from replaydiff.errors import UsageError

    if report.fingerprint:
        if report.fingerprint == trace.fingerprint:
            return None
        if os.path.realpath(report.trace or "") == os.path.realpath(trace_arg):
            raise UsageError(f"{replay_file} holds results of an earlier recording of {trace_arg} (it was recorded "
                             f"again since): replay it again with --json")
        raise UsageError(f"{replay_file} is a replay of {report.trace}, not {trace_arg}: replay {trace_arg} with "
                         f"--json, or use that trace")
    if report.trace and os.path.realpath(report.trace) != os.path.realpath(trace_arg):
        if os.path.isdir(report.trace):
            # Another trace that exists here: its results under this trace's name would mislead.
            raise UsageError(f"{replay_file} is a replay of {report.trace}, not {trace_arg}: replay {trace_arg} "
                             f"with --json, or report {report.trace}")
        return f"{replay_file} is a replay of {report.trace}, not {trace_arg}"
    return None

