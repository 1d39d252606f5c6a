"""What a diff of two traces produces: a typed ``DiffReport`` that reporters, the CLI and the terminal UI read.

Per pair of ranks (reference rank, target rank) a ``RankDiff`` holds one ``PairResult`` per aligned op pair, looked
up by ``(ref index, target index)`` or by either index alone, and the ops left unaligned on each side (structural
differences). A pair's ``PairStatus`` says whether it introduced a difference (``divergent``: inputs agree, outputs
do not), only carried an earlier one forward (``inherited``), matched (``same``) or had nothing to compare.
``StepInputs`` says whether the step's own inputs (tensors no op of the trace produced: parameters, optimizer state,
the batch, buffers) already differed when the step began: then the runs had parted before it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from replaydiff.trace.location import OpLocation
from replaydiff.compare.verdict import Verdict
from replaydiff.diff.environment import EnvDifference
from replaydiff.trace.damage import CutShort


class PairStatus(str, Enum):
    SAME = "same"
    DIVERGENT = "divergent"  # inputs agree, outputs do not: this op introduced the difference
    INHERITED = "inherited"  # outputs differ because an input already did
    NOT_COMPARED = "not_compared"  # no data on one side (meta trace, uninitialised output, nothing returned)

    def __str__(self) -> str:
        return self.value

    __format__ = lambda self, spec: format(self.value, spec)  # noqa: E731


class Evidence(str, Enum):
    """What a comparison could look at, weakest last."""

    FULL = "full tensors"
    STATS = "statistics only"
    SHAPES = "shapes only"

    def __str__(self) -> str:
        return self.value

    __format__ = lambda self, spec: format(self.value, spec)  # noqa: E731


_EVIDENCE_ORDER = [Evidence.FULL, Evidence.STATS, Evidence.SHAPES]


def weakest(evidence: list[Evidence]) -> Evidence | None:
    return max(evidence, key=_EVIDENCE_ORDER.index) if evidence else None


class OriginKind(str, Enum):
    PAIR = "pair"  # an earlier aligned pair
    TARGET_ONLY = "target_only"  # an op present in the target only
    OUTSIDE = "outside"  # not produced inside the trace: a parameter, the batch, a buffer
    UNIT = "unit"  # a compiled unit on one side, diffed against the eager ops of its region on the other

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Origin:
    """Where an inherited difference came from: an aligned pair, an op on one side only, or outside the trace.

    For an op on one side only, ``collective`` names the collective it depends on through other such ops, if any
    (DDP's gradient all-reduce, present only in a multi-process run, is the usual one)."""

    kind: OriginKind
    ref: int | None = None
    target: int | None = None
    op: str | None = None  # the target-only op's name
    collective: tuple[int, str] | None = None  # (target op number, name)

    def to_json(self) -> dict:
        if self.kind is OriginKind.PAIR:
            return {"pair": {"ref": self.ref, "target": self.target}}
        if self.kind is OriginKind.UNIT:
            return {"unit": {"ref": self.ref, "target": self.target}, "op": self.op}
        if self.kind is OriginKind.TARGET_ONLY:
            d: dict = {"target_only": self.target, "op": self.op}
            if self.collective is not None:
                d["collective"] = {"target": self.collective[0], "op": self.collective[1]}
            return d
        return {"outside": True}

    def describe(self) -> str:
        if self.kind is OriginKind.PAIR:
            return f"ref #{self.ref} / target #{self.target}"
        if self.kind is OriginKind.TARGET_ONLY:
            via = f", which depends on target-only collective #{self.collective[0]} {self.collective[1]}" \
                if self.collective is not None else ""
            return f"target-only op #{self.target} {self.op}{via}"
        if self.kind is OriginKind.UNIT:
            return f"compiled unit {self.op} (ref #{self.ref} / target #{self.target})"
        return "an input from outside the trace (parameter, batch or buffer)"


@dataclass(frozen=True)
class OpPlace:
    """An op of one trace: number, name, module and phase."""

    index: int
    op: str
    module: str | None
    phase: str | None

    def where(self) -> str:
        return "  ".join(x for x in (self.module or "", f"({self.phase})" if self.phase else "") if x)

    def to_json(self) -> dict:
        return {"index": self.index, "op": self.op, "module": self.module, "phase": self.phase}


@dataclass(frozen=True)
class StepInput:
    """A tensor that entered the step from outside the trace on both sides (a parameter, optimizer state, the batch,
    a buffer): the first reference op that reads it, and the aligned pair where the two runs' values were judged
    (the first pair that reads it on both sides as it came in: under autocast, the forward reads a cast copy)."""

    read_first: OpPlace  # in the reference
    ref: int  # the judging pair: op number in the reference
    target: int  # and in the target
    op: str
    position: int  # input position in that op
    module: str | None
    phase: str | None
    tensor: str  # dtype[shape] in the target, e.g. "float32[4, 16]"
    requires_grad: bool  # in the target (a parameter, or a loss or activation kept from a previous step)
    verdict: Verdict
    step: int | None = None  # the step of the reference op that first reads it (None: a trace without steps)

    def describe(self) -> str:
        # The trace does not record whether a tensor is a leaf: requires_grad alone does not make it a parameter.
        what = f"{self.tensor} (requires grad)" if self.requires_grad else self.tensor
        pair = f"ref #{self.ref} / target #{self.target} {self.op} input {self.position}"
        where = "  ".join(x for x in (self.module or "", f"({self.phase})" if self.phase else "") if x)
        rf = self.read_first
        if rf.index == self.ref:
            return f"{what} at {pair}  {where}".rstrip()
        return f"{what} read first by ref #{rf.index} {rf.op}  {rf.where()}, compared at {pair}  {where}".rstrip()

    def to_json(self) -> dict:
        return {"read_first": self.read_first.to_json(), "index": {"ref": self.ref, "target": self.target},
                "op": self.op, "position": self.position, "module": self.module, "phase": self.phase,
                "tensor": self.tensor, "requires_grad": self.requires_grad, "metrics": self.verdict.to_json(),
                "reason": self.verdict.reason, "step": self.step}


@dataclass
class StepInputs:
    """The step's inputs compared between the two runs: how many were judged, and those beyond tolerance, in the
    order the reference first reads them (a value only handed to Python, such as a printed loss, last)."""

    compared: int = 0
    differing: list[StepInput] = field(default_factory=list)
    first_step: int | None = None  # the reference trace's first recorded step (None: no step numbers)

    @property
    def differ(self) -> int:
        return len(self.differing)

    @property
    def first(self) -> StepInput | None:
        return self.differing[0] if self.differing else None

    def to_json(self) -> dict:
        return {"compared": self.compared, "differ": self.differ, "first_step": self.first_step,
                "first": None if self.first is None else self.first.to_json(),
                "differing": [d.to_json() for d in self.differing]}


@dataclass
class PairResult:
    ref: int  # op number in the reference rank's trace
    target: int  # op number in the target rank's trace
    op: str
    status: PairStatus
    module: str | None = None
    phase: str | None = None
    source: str | None = None
    forward_index: int | None = None  # for a backward op: the reference's forward op it belongs to
    location: OpLocation | None = None  # where the reference's op is (trace/location.py)
    target_op: str | None = None  # only when the aligned ops have different names (never, with today's keys)
    evidence: Evidence | None = None
    inputs_agree: bool | None = None  # None: no input could be compared
    verdict: Verdict | None = None  # the deciding output (the first divergent one, else the worst)
    reason: str | None = None
    inherited_from: Origin | None = None
    dtypes: tuple[str, str] | None = None  # (ref, target) output dtypes, when they differ (autocast on one side)
    # outputs beyond the fixed limits, but each side's op, replayed alone from its own inputs, is right (status same)
    explained: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.ref, self.target)

    @property
    def metrics(self) -> dict[str, Any] | None:
        return None if self.verdict is None else self.verdict.to_json()

    @property
    def severity(self) -> float | None:
        """How far over its limit the pair's deciding output is (Verdict.severity); None when nothing was compared."""
        return None if self.verdict is None else self.verdict.severity


@dataclass(frozen=True)
class Precision:
    """Aligned pairs that compute at different dtypes (autocast on one side): how many, and the limits they were
    judged at (the coarser dtype's)."""

    ref: str  # output dtype in the reference, e.g. "float32"
    target: str
    judged_at: str  # the coarser of the two
    pairs: int
    limit_max: float  # on max_abs/(eps*absmax), before any scaling for a long reduction
    limit_rel: float  # on rel_l2/eps

    def describe(self) -> str:
        return (f"{self.pairs} aligned pair(s) compute in {self.ref} in ref, {self.target} in target: judged at "
                f"{self.judged_at}'s limits (max_abs/(eps*absmax) {self.limit_max:g}, rel_l2/eps {self.limit_rel:g})")

    def to_json(self) -> dict:
        return {"ref": self.ref, "target": self.target, "judged_at": self.judged_at, "pairs": self.pairs,
                "limit_max": self.limit_max, "limit_rel": self.limit_rel}


@dataclass(frozen=True)
class UnitPart:
    """Where a compiled unit and the eager ops of its region part: the unit's node(s) standing for one eager op
    (several for a decomposition: inductor's GELU is mul, erf, add...) and that op of the other trace."""

    nodes: tuple[str, ...]  # ``erf (aten.erf.default)``, in graph order
    module: str | None  # the nodes' module, ``Sequential.1 (GELU)``
    eager: int  # the eager op's number in the other trace
    eager_op: str
    verdict: Verdict
    within: str | None = None  # of several nodes, the earliest whose value diverges from float64 on its own inputs

    def describe(self, eager_side: str = "eager") -> str:
        where = f" in {self.module}" if self.module else ""
        node = "node" if len(self.nodes) == 1 else "nodes"
        within = f"; of these, {self.within} diverges given its own inputs (against float64)" if self.within else ""
        return f"{node} {', '.join(self.nodes)}{where} = {eager_side} #{self.eager} {self.eager_op}{within}"

    def to_json(self) -> dict:
        return {"nodes": list(self.nodes), "module": self.module, "eager": self.eager, "eager_op": self.eager_op,
                "within": self.within, "metrics": self.verdict.to_json(), "reason": self.verdict.reason}


@dataclass(frozen=True)
class UnitPair:
    """A compiled unit of one trace diffed against the eager ops of the same region in the other: its boundaries
    (recorded inputs and outputs) against the eager ops its graph's nodes map onto, and where they part."""

    side: str  # the side holding the unit: "ref" or "target"
    unit: int  # its op number there
    op: str  # compiled.unit.forward / backward / inference
    region: str | None
    backend: str | None
    phase: str | None
    status: PairStatus
    eager: tuple[int, ...]  # the other side's ops its nodes map onto, in op order
    nodes: int  # the unit's call nodes
    matched: int  # of which mapped onto an eager op
    unmatched_nodes: tuple[str, ...]  # node names no eager op stands for
    unmatched_eager: tuple[int, ...]  # eager ops of the region no node stands for (left in the structural list)
    verdict: Verdict | None = None  # the deciding boundary output (the first divergent one, else the worst)
    part: UnitPart | None = None  # where they part (divergent units, when localised)
    reason: str | None = None

    @property
    def ref(self) -> int | None:
        return self.unit if self.side == "ref" else (self.eager[0] if self.eager else None)

    @property
    def target(self) -> int | None:
        return self.unit if self.side == "target" else (self.eager[0] if self.eager else None)

    def to_json(self) -> dict:
        return {"side": self.side, "unit": self.unit, "op": self.op, "region": self.region, "backend": self.backend,
                "phase": self.phase, "status": self.status.value, "eager": list(self.eager), "nodes": self.nodes,
                "matched": self.matched, "unmatched_nodes": list(self.unmatched_nodes),
                "unmatched_eager": list(self.unmatched_eager),
                "metrics": None if self.verdict is None else self.verdict.to_json(),
                "part": None if self.part is None else self.part.to_json(), "reason": self.reason}


@dataclass(frozen=True)
class Unaligned:
    """A run of consecutive ops present on one side only (``side`` is "ref" or "target")."""

    side: str
    ops: tuple[int, ...]
    names: tuple[str, ...]
    module: str | None
    phase: str | None

    @property
    def first(self) -> int:
        return self.ops[0]

    @property
    def last(self) -> int:
        return self.ops[-1]


@dataclass
class RankDiff:
    ref_rank: int
    target_rank: int
    pairs: list[PairResult] = field(default_factory=list)
    ref_only: list[Unaligned] = field(default_factory=list)
    target_only: list[Unaligned] = field(default_factory=list)
    ref_ops: int = 0
    target_ops: int = 0
    step_inputs: StepInputs = field(default_factory=StepInputs)
    units: list[UnitPair] = field(default_factory=list)  # compiled units against eager ops of their region
    precision: list[Precision] = field(default_factory=list)  # pairs computed at different dtypes, per dtype pair

    def __post_init__(self) -> None:
        self._index()

    def _index(self) -> None:
        self.by_key: dict[tuple[int, int], PairResult] = {p.key: p for p in self.pairs}
        self.by_ref: dict[int, PairResult] = {p.ref: p for p in self.pairs}
        self.by_target: dict[int, PairResult] = {p.target: p for p in self.pairs}

    def add(self, p: PairResult) -> None:
        self.pairs.append(p)
        self.by_key[p.key] = self.by_ref[p.ref] = self.by_target[p.target] = p

    @property
    def ref_only_ops(self) -> frozenset[int]:
        """Reference op numbers left unaligned (for marking rows of the reference's op list)."""
        return frozenset(i for u in self.ref_only for i in u.ops)

    @property
    def target_only_ops(self) -> frozenset[int]:
        return frozenset(i for u in self.target_only for i in u.ops)

    def pair(self, ref: int, target: int) -> PairResult | None:
        return self.by_key.get((ref, target))

    def counts(self) -> dict[str, int]:
        c = {s.value: 0 for s in PairStatus}
        for p in self.pairs:
            c[p.status.value] += 1
        c["ref_only"] = sum(len(u.ops) for u in self.ref_only)
        c["target_only"] = sum(len(u.ops) for u in self.target_only)
        c["units"] = len(self.units)
        c["units_divergent"] = sum(u.status is PairStatus.DIVERGENT for u in self.units)
        return c

    @property
    def first_divergent(self) -> PairResult | None:
        """The earliest aligned op whose inputs agree and whose outputs do not."""
        return next((p for p in self.pairs if p.status is PairStatus.DIVERGENT), None)

    @property
    def first_difference(self) -> PairResult | None:
        """The earliest aligned op whose outputs differ, introduced there or not."""
        return next((p for p in self.pairs if p.status in (PairStatus.DIVERGENT, PairStatus.INHERITED)), None)

    @property
    def explained(self) -> list[PairResult]:
        """Pairs whose outputs differ beyond the fixed limits while each side's op is right given its own inputs."""
        return [p for p in self.pairs if p.explained]

    @property
    def evidence(self) -> list[Evidence]:
        return sorted({p.evidence for p in self.pairs if p.evidence is not None}, key=_EVIDENCE_ORDER.index)


@dataclass
class DiffReport:
    ref: str
    target: str
    options: dict[str, Any]
    environment: list[EnvDifference] = field(default_factory=list)
    ranks: list[RankDiff] = field(default_factory=list)
    baseline: str | None = None
    warnings: list[str] = field(default_factory=list)
    steps: str | None = None  # which steps are compared, when the traces hold different steps (or --step picked)
    # Faults planted while recording (record --plant), one line per side and rank: every report says so first.
    planted: list[str] = field(default_factory=list)
    # A parallel run against the single process: its ranks mapped onto it op by op (diff/parallel.py), in place
    # of rank-by-rank pairs.
    parallel: Any = None
    # Sides whose recording stopped part-way ("reference" or "target", and where: RankTrace.cut_short): what came after
    # was never recorded, so never compared, and the diff is never clean.
    cut_short: list[tuple[str, CutShort]] = field(default_factory=list)

    def candidates(self) -> list[tuple[RankDiff, PairResult]]:
        """One first divergence per rank pair, earliest (by reference op number) first."""
        found = [(rd, rd.first_divergent) for rd in self.ranks if rd.first_divergent is not None]
        return sorted(found, key=lambda x: (x[1].ref, x[0].target_rank))  # type: ignore[union-attr]

    @property
    def first_divergent(self) -> tuple[RankDiff, PairResult] | None:
        c = self.candidates()
        return c[0] if c else None

    @property
    def found_difference(self) -> bool:
        """The runs part ways: some aligned op's outputs differ (introduced or inherited), or the step's inputs
        already did."""
        if self.parallel is not None and self.parallel.not_clean:
            return True
        return any(rd.first_difference is not None or rd.step_inputs.differ or
                   any(u.status in (PairStatus.DIVERGENT, PairStatus.INHERITED) for u in rd.units)
                   for rd in self.ranks)

    @property
    def step_inputs_differ(self) -> list[RankDiff]:
        """The rank pairs whose step began from inputs that already differed."""
        return [rd for rd in self.ranks if rd.step_inputs.differ]

    def counts(self) -> dict[str, int]:
        """Pair counts per status and ops on one side only, over every rank pair; for a parallel run mapped onto
        the single process, the mapping's (``ParallelDiff.counts``)."""
        if self.parallel is not None:
            return self.parallel.counts()
        total: dict[str, int] = {}
        for rd in self.ranks:
            for k, v in rd.counts().items():
                total[k] = total.get(k, 0) + v
        return total or {**{s.value: 0 for s in PairStatus}, "ref_only": 0, "target_only": 0, "units": 0,
                         "units_divergent": 0}
