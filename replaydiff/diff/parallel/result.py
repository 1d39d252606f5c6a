"""The parallel diff's results: each aligned op's tensors as the ranks hold them, where the runs part, the whole
diff."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from dataclasses import field
from enum import Enum
from fractions import Fraction

from replaydiff.diff.parallel.settings import SettingDifference
from replaydiff.compare.layout import Layout, ratio_text
from replaydiff.compare.reordered import Limit
from replaydiff.trace.placements import DTensorArg
from replaydiff.diff.parallel.declared import declares


class Departure(str, Enum):
    NO_LAYOUT = "no_layout"  # the ranks' outputs map onto the reference's under no layout
    SCALED = "scaled"  # they map, at a factor a correct parallel run does not have there
    UNREDUCED = "unreduced"  # an input is partial (its sum over ranks is the value) and no layout fits the output
    INPUTS = "inputs"  # a tensor from outside the step (parameter, batch) maps under no layout at factor 1
    SHARD_OFFSET = "shard_offset"  # each rank holds a slice of the reference, but not the slice of its rank
    SAME_SHARD = "same_shard"  # every rank holds the same slice of the batch (each read the same shard)

    def __str__(self) -> str:
        return self.value



@dataclass(frozen=True)
class Mapped:
    """One tensor of an aligned op (an output, or an input from outside the step) and how the ranks hold it."""

    kind: str  # "out" or "in"
    position: int
    describe: str  # the reference's dtype and shape
    layout: Layout | None  # None: no layout fits; else the first of ``fits`` at a factor a correct run has there
    error: float | None  # rel_l2 / eps(recorded dtype) of the mapped value against the reference's (None: no layout)
    # No layout, and every rank holds the reference's shape: the ranks that do not hold the reference's value
    # (the others do: a fault on some ranks); empty when none holds it.
    off: tuple[int, ...] = ()
    # No layout, and each rank holds a slice of the reference along dim ``offsets[0]``, but not in rank order: the
    # offset of each rank's slice.
    offsets: tuple[int, tuple[int, ...]] | None = None
    fits: tuple[Layout, ...] = ()  # every layout that fits, plainest first
    sizes: tuple[int, ...] | None = None  # with ``offsets``: each rank's extent along that dim
    declared: DTensorArg | None = None  # the placements DTensor declared for it on the ranks, where recorded
    alike: bool = False  # no layout fits, and every rank holds the same piece of it (each read the same shard)
    limit: float | None = None  # the rel_l2 / eps a mapped value may reach and fit (``bound.eps``); None: exact
    bound: Limit | None = None  # how ``limit`` was formed (compare/reordered.py); None: exact

    @property
    def layout_from(self) -> str | None:
        """'placements' when the layout used is the one DTensor declared, 'inferred' when it was found from the
        tensors alone (no placements recorded, or others than the layout that fits); None: no layout fits."""
        if self.layout is None:
            return None
        return "placements" if self.declared is not None and declares(self.declared, self.layout) else "inferred"



@dataclass(frozen=True)
class MappedOp:
    ref: int
    targets: tuple[int, ...]  # its op number on each rank, in rank order
    name: str
    module: str | None
    phase: str | None
    source: str | None  # a backward op: the source line of the forward op it belongs to, where known
    tensors: tuple[Mapped, ...]
    ranks: tuple[int, ...] = ()  # the rank of each of ``targets`` when not every rank runs it (a micro-batch's op)
    ref_rank: int | None = None  # the reference is a parallel run too: the rank ``ref`` is numbered on
    # the first rank's source line where it is not the reference's (the ranks run this op from another line of the
    # script: a branch taken when the world size is not 1); None: the same
    target_source: str | None = None

    def on_ranks(self) -> list[tuple[int, int]]:
        """(rank, op number on that rank) for every rank that runs it."""
        return list(zip(self.ranks or range(len(self.targets)), self.targets))



@dataclass(frozen=True)
class RanksOnlyScale:
    """An op the ranks run and the single process does not, that multiplies what it reads by the factor a departure
    parts by: where that difference enters (a loss multiplied by the world size in the parallel script only). A
    backward op is named by the forward op it belongs to, the line the job wrote."""

    rank: int
    index: int  # the op's number on ``rank``
    name: str
    phase: str | None
    source: str | None
    factor: Fraction  # what it multiplies its input by, measured on the rank's recorded tensors
    world: int
    of_loss: bool  # it scales a one-element forward value that the backward differentiates (the loss)
    # the scales the ranks apply to their loss beyond the single process's (a loss divided by the world size where
    # the gradients are divided too), each 'name (#N on rank R, line): factor' (paths.loss_scales); None: none
    also: str | None = None
    # the ranks that run it where the other ranks do not (one rank's own scale); None: every rank runs it
    alone: tuple[int, ...] | None = None

    def who(self) -> str:
        """'the ranks', or 'rank 1' where some ranks alone run it."""
        return "the ranks" if self.alone is None else \
            f"rank{'s' if len(self.alone) > 1 else ''} {', '.join(map(str, self.alone))}"

    def describe(self) -> str:
        """What it does, in words: 'multiplies the loss by 2 (the world size) on every rank ...'."""
        k = ratio_text(self.factor)
        if self.alone is not None:
            if self.factor.denominator > 8:  # 21/20 is 1.05 as the script wrote it
                k = format(float(self.factor), ".6g")
            others = [r for r in range(self.world) if r not in self.alone]
            return (f"it multiplies {'the loss' if self.of_loss else 'what it reads'} by {k} on {self.who()}, and "
                    f"neither the single process nor rank{'s' if len(others) > 1 else ''} "
                    f"{', '.join(map(str, others))} run{'s' if len(others) == 1 else ''} such an op: a scale of "
                    f"{self.who()}'s own")
        said = " (the world size)" if self.factor == self.world else " (1 over the world size)" \
            if self.factor == Fraction(1, self.world) else ""
        what = "the loss" if self.of_loss else "what it reads"
        why = ": the gradients are already averaged over the ranks (DistributedDataParallel and FSDP divide their " \
              "sum by the world size), so nothing cancels this scale" if self.of_loss and self.factor == self.world \
            else ""
        if self.also is not None:
            why += f"; the ranks scale their loss too ({self.also}): with this op's, one scale too many"
        return f"it multiplies {what} by {k}{said} on the ranks, and the single process runs no such op{why}"


@dataclass(frozen=True)
class ParallelDeparture:
    op: MappedOp
    tensor: Mapped
    kind: Departure
    why: str  # one line for people
    inherited: int  # later aligned ops that read what it made and part from the reference too
    # the step's inputs differ at a step after the job's first: what may have parted the runs, and the command that
    # finds it (``earlier_step``); None otherwise
    earlier: str | None = None
    step: int | None = None  # the step compared, where the trace numbers its ops
    # the factor this op applies: what a correct run holds here (a root), or what it reads (a value on the way that
    # parted already), over what it holds; None: not a factor
    applied: Fraction | None = None
    via: str | None = None  # the ranks' own computing op it reads from, 'name (#N on rank R, line)'; None: none
    # where the factor it parts by enters, when an op only the ranks run applies it (the headline then); None: none
    enters: RanksOnlyScale | None = None


@dataclass
class ParallelDiff:
    """A run of ``world`` ranks mapped onto a single process, op by op (see the module docstring)."""

    world: int
    ref_ops: int
    aligned: int  # reference ops every rank runs
    compared: int  # of those, ops with at least one tensor compared
    not_aligned: list[int] = field(default_factory=list)  # reference ops some rank does not run
    layout_ops: Counter = field(default_factory=Counter)  # target-only op names, all ranks together
    # those of layout_ops that the ranks do not all run as often: name -> each rank's count
    uneven_ops: dict[str, tuple[int, ...]] = field(default_factory=dict)
    families: dict[str, Counter] = field(default_factory=dict)  # phase -> Counter(layout family) of outputs
    random_ops: int = 0  # aligned random ops, not compared
    not_stored: int = 0  # aligned ops whose tensors the traces do not hold (stats or meta traces)
    worst: float = 0.0  # the rel_l2 / eps of the tensor that maps nearest its limit (``worst_limit``)
    worst_limit: float | None = None  # that tensor's limit, in eps of its dtype
    worst_op: int | None = None  # the reference op it belongs to
    departure: ParallelDeparture | None = None
    ops: list[MappedOp] = field(default_factory=list)
    # reference ops that part from the reference: whose tensors fit no layout a correct run has, or that read what
    # parted (a value that parts on the way and cancels before the sinks included)
    parted: set[int] = field(default_factory=set)
    # ops that fit no layout only because they read random draws (dropout masks), each rank's own: not judged
    random_parted: list[int] = field(default_factory=list)
    # factories of no tensor (arange over the local batch) whose ranks' outputs are sized by their local sizes: each
    # rank's own index, not compared with the single process's
    per_rank_index: list[int] = field(default_factory=list)
    # ops whose inputs every rank holds whole and alike, right given them, whose outputs part from the reference's
    # only as far as the inputs' rounding, amplified, takes them: no departure
    amplified: list[int] = field(default_factory=list)
    # the reference ran the global batch as this many gradient-accumulation micro-batches, rank r's ops mapped onto
    # micro-batch r's (0: one pass, every rank's ops onto it)
    micro_batches: int = 0
    # each rank ran its share of the global batch as this many micro-batches, gradients accumulated (no_sync), where
    # the single process runs it at once: the reference's forward and backward mapped onto every (rank, micro-batch)
    # (0: each rank one pass)
    rank_micro_batches: int = 0
    ref_only: Counter = field(default_factory=Counter)  # names of the computing ops in ``not_aligned``
    # the reference is a parallel run of ``ref_world`` ranks: each of its ranks q against the target's ranks q*m to
    # q*m+m-1 (m = world / ref_world), one diff each (``groups``); the fields above sum them
    ref_world: int = 1
    groups: list["ParallelDiff"] = field(default_factory=list)
    # one line when the runs did not see the same global batch (a tensor from outside the step that needs no
    # gradient, read in the forward, maps under no layout at factor 1); None: not seen
    batch_warning: str | None = None
    # the first op that parted picks one row of a dataset, and the ranks pick the single process's rows between
    # them in another order (a DistributedSampler interleaves): the same global batch, no departure (rows.py)
    rows_reordered: int | None = None
    # the ranks' traces hold DTensor placements: (compared tensors whose layout is the one DTensor declared, the
    # others, inferred from the tensors); None: none recorded
    from_placements: tuple[int, int] | None = None
    ref_layout_ops: Counter = field(default_factory=Counter)  # the reference's own collectives, not compared
    # random ops whose draws every rank holds alike where each holds a piece of the reference's (a dropout mask
    # of each rank's slice of the batch): the same seed on every rank, each slice masked alike
    same_draws: list[int] = field(default_factory=list)
    # the step's inputs differ (``departure`` of kind inputs): the first op that parts reading none of what they
    # made, as the rank-by-rank diff names the first op whose inputs agree; None: every op that parts inherits them
    within: ParallelDeparture | None = None
    # compared ops whose values the job keeps (sinks.py); 0: none compared, every op is judged where it parts
    sinks: int = 0
    # values that part from the reference and reach no sink that parts (a factor the job cancels later): said, not
    # a departure
    cancelled: list[ParallelDeparture] = field(default_factory=list)
    # where the factors cancel: the rank's own op the optimizer reads from (None: not found)
    restored: str | None = None
    # a sink parts: the values on its way, in order, that apply a factor (with ``departure``'s tensor's: the net)
    sites: list[ParallelDeparture] = field(default_factory=list)
    settings: list[SettingDifference] = field(default_factory=list)  # the optimizer's settings that differ
    sink: ParallelDeparture | None = None  # the first sink that parts: its op and tensor (the net factor)

    @property
    def worst_bound(self) -> Limit | None:
        """How the limit of the tensor that maps nearest its limit was formed (``worst_limit``); None: none."""
        if self.worst_limit is None:
            return None
        op = next((o for o in self.ops if o.ref == self.worst_op), None)
        near = [] if op is None else [m for m in op.tensors if m.bound is not None and m.limit == self.worst_limit
                                      and m.error == self.worst]
        return near[0].bound if near else None

    def counts(self) -> dict[str, int]:
        """The JSON summary: the rank-by-rank diff's keys, each meaning what it means there, and the figures the text
        says. ``same``: compared ops that map onto the reference (an op that only amplifies its inputs' rounding, or
        parts only by the order of the batch's rows, included); ``divergent``: the op where the runs part with
        agreeing inputs (1 or 0; with step inputs that differ, the first op that parts reading none of them);
        ``inherited``: the later ops that part reading what the departure made; ``not_compared``: ops every rank runs
        whose tensors were not judged (random draws, no tensor data, each rank's own index); ``ref_only``: reference
        ops not run by every rank; ``target_only``: the ranks' layout ops, all ranks together. Then ``ref_ops``,
        ``aligned``, ``compared``, ``parted`` (every compared op that parts, the departure, what inherits it and
        values that cancel before the sinks), ``cancelled``, ``amplified``, ``not_judged_random``, ``sinks``.
        same + parted + not_compared = aligned. Against a parallel reference, its groups summed."""
        if self.groups:
            total: Counter = Counter()
            for g in self.groups:
                total.update(g.counts())
            return {**total, "divergent": self._divergent(), "inherited": self._inherited()}
        unjudged = len(self.random_parted) + len(self.per_rank_index)
        return {"same": self.compared - len(self.parted) - unjudged, "divergent": self._divergent(),
                "inherited": self._inherited(), "not_compared": self.aligned - self.compared + unjudged,
                "ref_only": len(self.not_aligned), "target_only": sum(self.layout_ops.values()), "units": 0,
                "units_divergent": 0, "ref_ops": self.ref_ops, "aligned": self.aligned, "compared": self.compared,
                "parted": len(self.parted), "cancelled": len(self.cancelled), "amplified": len(self.amplified),
                "not_judged_random": len(self.random_parted), "sinks": self.sinks}

    def _divergent(self) -> int:
        d = self.departure
        return int(d is not None and (d.kind is not Departure.INPUTS or self.within is not None))

    def _inherited(self) -> int:
        return 0 if self.departure is None else self.departure.inherited

    @property
    def departed(self) -> bool:
        return self.departure is not None

    @property
    def not_clean(self) -> bool:
        """The runs part, or some ops could not be judged (they read random draws the ranks make their own)."""
        return self.departure is not None or bool(self.random_parted)

    def to_json(self) -> dict:
        d = self.departure
        return {
            "world": self.world, "ref_ops": self.ref_ops, "aligned": self.aligned, "compared": self.compared,
            "not_aligned": list(self.not_aligned), "layout_ops": dict(self.layout_ops),
            "uneven_ops": {k: list(v) for k, v in self.uneven_ops.items()},
            "families": {k: dict(v) for k, v in self.families.items()}, "random_ops": self.random_ops,
            "not_stored": self.not_stored, "worst_rel_l2_over_eps": self.worst,
            **({"worst_limit_over_eps": self.worst_limit, "worst_ref": self.worst_op,
                **({"worst_limit": self.worst_bound.to_json()} if self.worst_bound is not None else {})}
               if self.worst_limit is not None else {}),
            "not_judged_random": list(self.random_parted), "amplified": list(self.amplified),
            "sinks": self.sinks, "per_rank_index": list(self.per_rank_index),
            **({"rows_reordered": self.rows_reordered} if self.rows_reordered is not None else {}),
            "cancelled": [_site(c) for c in self.cancelled],
            **({"restored": self.restored} if self.restored else {}),
            **({"sites": [_site(c) for c in self.sites]} if self.sites else {}),
            **({"sink": _site(self.sink)} if self.sink is not None else {}),
            **({"optimizer_settings": [{"optimizer": d.kind, "group": d.group, "name": d.name, "ref": d.ref,
                                        "target": d.theirs, "rank": d.rank, **({"built": d.built} if d.built else {})}
                                       for d in self.settings]}
               if self.settings else {}),
            **({"same_draws": list(self.same_draws)} if self.same_draws else {}),
            **({"micro_batches": self.micro_batches, "ref_only": dict(self.ref_only)} if self.micro_batches else {}),
            **({"rank_micro_batches": self.rank_micro_batches} if self.rank_micro_batches else {}),
            **({"layouts_from_placements": self.from_placements[0], "layouts_inferred": self.from_placements[1]}
               if self.from_placements is not None else {}),
            **({"ref_world": self.ref_world, "ref_layout_ops": dict(self.ref_layout_ops),
                "groups": [g.to_json() for g in self.groups]} if self.ref_world > 1 else {}),
            **({"within": None if self.within is None else {
                "kind": self.within.kind.value, "why": self.within.why, "ref": self.within.op.ref,
                "targets": list(self.within.op.targets), "op": self.within.op.name, "module": self.within.op.module,
                "phase": self.within.op.phase, "source": self.within.op.source}}
               if d is not None and d.kind is Departure.INPUTS else {}),
            "departure": None if d is None else {
                "kind": d.kind.value, "why": d.why, "inherited": d.inherited, "ref": d.op.ref,
                **({"step": d.step} if d.step is not None else {}),
                **({"earlier_step": {"why": d.earlier, "command": "replaydiff record --step 1"}}
                   if d.earlier is not None else {}),
                **({"enters": {"rank": d.enters.rank, "index": d.enters.index, "op": d.enters.name,
                               "phase": d.enters.phase, "source": d.enters.source, "applies": str(d.enters.factor),
                               "why": d.enters.describe(),
                               "alone": None if d.enters.alone is None else list(d.enters.alone)}}
                   if d.enters is not None else {}),
                "targets": list(d.op.targets), **({"ranks": list(d.op.ranks)} if d.op.ranks else {}),
                **({"ref_rank": d.op.ref_rank} if d.op.ref_rank is not None else {}), "op": d.op.name, "module": d.op.module, "phase": d.op.phase,
                "source": d.op.source, **({"target_source": d.op.target_source} if d.op.target_source else {}),
                "tensor": {"kind": d.tensor.kind, "position": d.tensor.position,
                                                  "describe": d.tensor.describe,
                                                  **({"layout_from": d.tensor.layout_from,
                                                      "placements": d.tensor.declared.describe()}
                                                     if d.tensor.declared is not None else {}),
                                                  "layout": None if d.tensor.layout is None else
                                                  d.tensor.layout.to_json()}},
        }


def _site(d: ParallelDeparture) -> dict:
    """One value that parts, for the JSON report: its op, line, words and layout (with the factor)."""
    return {"ref": d.op.ref, "op": d.op.name, "phase": d.op.phase, "source": d.op.source, "kind": d.kind.value,
            "why": d.why, "layout": None if d.tensor.layout is None else d.tensor.layout.to_json(),
            **({"applies": str(d.applied)} if d.applied is not None else {}),
            **({"via": d.via} if d.via is not None else {})}
