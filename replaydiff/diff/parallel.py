"""Diffing a parallel run against the single-process run: every aligned op's values mapped through their layout.

Under data, fully-sharded or tensor parallelism no rank holds the single process's values: rank r holds its slice
of the batch, its shard of a weight, or its share of a gradient that an all-reduce sums later. Comparing rank r's
op with the single process's op by op (as ``engine.diff_ranks`` does for two runs of one layout) calls every such
value a difference. Here each op of the reference that every rank runs (aligned per rank, as ``align`` does) is
compared once for all ranks: its outputs on the W ranks are mapped onto the reference's through the layout that
fits (``compare.layout``: replicated, sharded on a dimension, partial), and the step's inputs the ops read
(parameters, the batch) the same way. What is not computation is not compared: the ops one side alone runs (the
collectives, DDP's bucket copies, FSDP's copy-in and copy-out, the slicing of the batch) are how layouts are made and
rejoined, and are listed as layout ops.

A correct parallel run maps everywhere at factor 1, except partial values that are the sum of per-rank means (the
loss, and the local gradients before their all-reduce: the reference is their average, factor 1/world). The first
op, in the reference's order, whose outputs map under no layout, or only at another factor, and whose inputs did
map, is where the runs part: a scale applied on every rank (a loss scaled by the world size twice), partial sums
used without their all-reduce, per-rank statistics that should be global (BatchNorm without SyncBatchNorm, a mean
over uneven token counts), a shard taken at the wrong offset. Ops after it that read what it made inherit it.

Random ops (dropout) are not compared: each rank draws its own numbers, so their outputs and what reads them are
judged only if they map anyway.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction
from typing import Callable

import torch

from replaydiff import aten
from replaydiff.compare.layout import (Close, Layout, LayoutKind, infer_layouts, infer_mesh_layouts, ratio_text,
                                       rel_l2_close, shard_offsets)
from replaydiff.diff.align import OpKeys, align, op_keys
from replaydiff.errors import UsageError
from replaydiff.trace.placements import DTensorArg, Placement, declared_inputs, read_notes
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import OpRecord, TensorRef


class Departure(str, Enum):
    NO_LAYOUT = "no_layout"  # the ranks' outputs map onto the reference's under no layout
    SCALED = "scaled"  # they map, at a factor a correct parallel run does not have there
    UNREDUCED = "unreduced"  # an input is partial (its sum over ranks is the value) and no layout fits the output
    INPUTS = "inputs"  # a tensor from outside the step (parameter, batch) maps under no layout at factor 1
    SHARD_OFFSET = "shard_offset"  # each rank holds a slice of the reference, but not the slice of its rank

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

    @property
    def layout_from(self) -> str | None:
        """'placements' when the layout used is the one DTensor declared, 'inferred' when it was found from the
        tensors alone (no placements recorded, or others than the layout that fits); None: no layout fits."""
        if self.layout is None:
            return None
        return "placements" if self.declared is not None and _declares(self.declared, self.layout) else "inferred"


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

    def on_ranks(self) -> list[tuple[int, int]]:
        """(rank, op number on that rank) for every rank that runs it."""
        return list(zip(self.ranks or range(len(self.targets)), self.targets))


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


@dataclass
class ParallelDiff:
    """A run of ``world`` ranks mapped onto a single process, op by op (see the module docstring)."""

    world: int
    ref_ops: int
    aligned: int  # reference ops every rank runs
    compared: int  # of those, ops with at least one tensor compared
    not_aligned: list[int] = field(default_factory=list)  # reference ops some rank does not run
    layout_ops: Counter = field(default_factory=Counter)  # target-only op names, all ranks together
    families: dict[str, Counter] = field(default_factory=dict)  # phase -> Counter(layout family) of outputs
    random_ops: int = 0  # aligned random ops, not compared
    not_stored: int = 0  # aligned ops whose tensors the traces do not hold (stats or meta traces)
    worst: float = 0.0  # the largest rel_l2 / eps among the tensors that map
    departure: ParallelDeparture | None = None
    ops: list[MappedOp] = field(default_factory=list)
    parted: set[int] = field(default_factory=set)  # reference ops whose tensors fit no layout a correct run has
    # ops that fit no layout only because they read random draws (dropout masks), each rank's own: not judged
    random_parted: list[int] = field(default_factory=list)
    # ops whose inputs every rank holds whole and alike, right given them, whose outputs part from the reference's
    # only as far as the inputs' rounding, amplified, takes them: no departure
    amplified: list[int] = field(default_factory=list)
    # the reference ran the global batch as this many gradient-accumulation micro-batches, rank r's ops mapped onto
    # micro-batch r's (0: one pass, every rank's ops onto it)
    micro_batches: int = 0
    ref_only: Counter = field(default_factory=Counter)  # names of the computing ops in ``not_aligned``
    # the reference is a parallel run of ``ref_world`` ranks: each of its ranks q against the target's ranks q*m to
    # q*m+m-1 (m = world / ref_world), one diff each (``groups``); the fields above sum them
    ref_world: int = 1
    groups: list["ParallelDiff"] = field(default_factory=list)
    # one line when the runs did not see the same global batch (a tensor from outside the step that needs no
    # gradient, read in the forward, maps under no layout at factor 1); None: not seen
    batch_warning: str | None = None
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
            "families": {k: dict(v) for k, v in self.families.items()}, "random_ops": self.random_ops,
            "not_stored": self.not_stored, "worst_rel_l2_over_eps": self.worst,
            "not_judged_random": list(self.random_parted), "amplified": list(self.amplified),
            **({"same_draws": list(self.same_draws)} if self.same_draws else {}),
            **({"micro_batches": self.micro_batches, "ref_only": dict(self.ref_only)} if self.micro_batches else {}),
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
                "targets": list(d.op.targets), **({"ranks": list(d.op.ranks)} if d.op.ranks else {}),
                **({"ref_rank": d.op.ref_rank} if d.op.ref_rank is not None else {}), "op": d.op.name, "module": d.op.module, "phase": d.op.phase,
                "source": d.op.source, "tensor": {"kind": d.tensor.kind, "position": d.tensor.position,
                                                  "describe": d.tensor.describe,
                                                  **({"layout_from": d.tensor.layout_from,
                                                      "placements": d.tensor.declared.describe()}
                                                     if d.tensor.declared is not None else {}),
                                                  "layout": None if d.tensor.layout is None else
                                                  d.tensor.layout.to_json()}},
        }


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


def is_parallel_pair(ref_world: int, ref_ranks: list[int], target_world: int, target_ranks: list[int]) -> bool:
    """A single-process reference against every rank of a job of world size > 1: the case mapped here."""
    return ref_world <= 1 and len(ref_ranks) == 1 and target_world > 1 and target_ranks == list(range(target_world))


def close_for(dtype: torch.dtype) -> Close:
    """Whether a mapped value is the reference's: rel_l2 within sqrt(eps) of the recorded dtype (half its digits:
    a reordered sum, a gradient reduced in another order and what they feed stay orders of magnitude inside; a
    scale, an unreduced sum or per-rank statistics fall far outside); integers and booleans exactly."""
    if dtype.is_floating_point:
        return rel_l2_close(math.sqrt(torch.finfo(dtype).eps))

    def exact(x: torch.Tensor, ref: torch.Tensor) -> bool:
        return tuple(x.shape) == tuple(ref.shape) and torch.equal(x.to(torch.float64), ref.to(torch.float64))

    return exact


def _family(layout: Layout, legit: bool) -> str:
    """The summary line's name of a layout: its kind, and a factor a correct run has named for what it is."""
    if layout.inner is not None:  # a 2-D mesh: the groups' layout, then how each group holds its part
        outer = _family(dataclasses.replace(layout, inner=None, groups=None), legit)
        inner = _family(layout.inner, True)
        return f"{outer} (each mesh {'row' if layout.groups and layout.groups[0] == tuple(range(len(layout.groups[0]))) else 'column'}: {inner})"
    if layout.micro_batch is not None:
        at = "" if layout.factor == 1 else f" at {ratio_text(1 / layout.factor)}x"
        return f"each rank's own, against its micro-batch{at}" + \
            (" (of a loss divided by the micro-batch count)" if legit and layout.factor != 1 else "")
    if layout.kind is LayoutKind.PARTIAL:
        if layout.factor == 1:
            return "partial (a sum)"
        if layout.factor == Fraction(1, layout.world):
            return "partial (a per-rank mean)"
        return f"partial at {ratio_text(1 / layout.factor)}x"
    if layout.kind in (LayoutKind.MAX, LayoutKind.MIN):
        return f"{layout.kind.value} over ranks"
    text = f"sharded on dim {layout.dim}" if layout.kind is LayoutKind.SHARDED else "replicated"
    if layout.factor == 1:
        return text
    return f"{text} (of a per-rank mean)" if legit and layout.factor == Fraction(1, layout.world) else \
        f"{text} at {ratio_text(1 / layout.factor)}x"


def _pick(m: Mapped, phase: str | None, loss: Fraction | None) -> Mapped:
    """Of the layouts that fit, the first at a factor a correct run has there (a count each rank holds a quarter of
    is partial, not replicated at 1/4), else the plainest."""
    good = next((f for f in m.fits if f.factor in _legit_factors(f, phase, loss)), None)
    if good is None or good is m.layout:
        return m
    return dataclasses.replace(m, layout=good)


def _legit_factors(layout: Layout, phase: str | None, loss: Fraction | None) -> tuple[Fraction, ...]:
    """The factors a correct parallel run has: 1; 1/world for a per-rank mean in the forward (a partial value: the
    loss of a rank's slice of the batch); and in the backward the factor of the loss it differentiates (``loss``:
    each rank's gradients are of its own loss, 1/world of the reference's in sum when that is a per-rank mean), until
    the gradients' all-reduce divides by the world size."""
    if layout.micro_batch is not None:
        # rank r's own value against micro-batch r's: the same, but for the gradients of a reference that divides
        # each micro-batch's loss by the number of micro-batches (the world size), as gradient accumulation does
        return (Fraction(1), Fraction(1, layout.world)) if phase == "backward" else (Fraction(1),)
    if phase == "backward":
        return (Fraction(1),) if loss is None or loss == 1 else (Fraction(1), loss)
    if layout.kind is LayoutKind.PARTIAL and phase != "optimizer":
        return Fraction(1), Fraction(1, layout.world)
    return (Fraction(1),)


def _rel_l2(layout: Layout, parts: list[torch.Tensor], ref: torch.Tensor) -> float:
    """The relative L2 error of the ranks' mapped value against the reference, over positions finite in both."""
    m, b = layout.mapped(parts), ref.to(torch.float64)
    keep = torch.isfinite(m) & torch.isfinite(b)
    den = float(torch.linalg.vector_norm(b[keep]))
    num = float(torch.linalg.vector_norm((m - b)[keep]))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _makes_layout(name: str) -> bool:
    """A collective: how a parallel run makes and rejoins its layouts."""
    return aten.is_collective(name)


def _layout_keys(op: OpRecord) -> OpKeys:
    """Alignment keys that hold across layouts: the strict key has each tensor's number of dimensions where
    ``op_keys`` has its shape (a rank's shard and the single process's whole tensor differ in shape, and a square
    shard would pair with an unrelated op of that square shape)."""
    k = op_keys(op)
    ins = tuple(len(r.shape) for r in op.inputs())
    outs = tuple(len(r.shape) for r in op.outputs_refs())
    return OpKeys(k.index, (*k.loose, ins, outs), k.loose)


class _Side:
    """One rank's recorded ops and their alignment keys, read once. ``skip_collectives``: a reference that is a
    parallel run itself, whose collectives rejoin its own layout and have no counterpart in the target's."""

    def __init__(self, trace: RankTrace, skip_collectives: bool = False) -> None:
        self.trace = trace
        self.ops: dict[int, OpRecord] = {}
        self.keys: list[OpKeys] = []
        self.skipped: set[int] = set()
        for op in trace:
            self.ops[op.index] = op
            # profiler markers compute nothing, and as anchors they pair FSDP's and DDP's record_function ranges with
            # the single process's few, pulling the ops between them apart: they are left out of the alignment
            if aten.is_marker(op.name) or (skip_collectives and _makes_layout(op.name)):
                self.skipped.add(op.index)
            else:
                self.keys.append(_layout_keys(op))

    @functools.cached_property
    def notes(self) -> list:
        """DTensor's placements as the recorder noted them on this rank, read once (the layouts and the mesh use
        them)."""
        return read_notes(self.trace.root)


def diff_parallel(ref: RankTrace, targets: list[RankTrace],
                  progress: Callable[[int], None] | None = None, cut_short: bool = False,
                  full_world: int | None = None) -> ParallelDiff:
    """Map every rank of ``targets`` (rank order, world size ``len(targets)``) onto the single-process ``ref``;
    ``cut_short``: a side was cut short, so ops missing on the ranks are no sign of another program.
    ``full_world``: ``ref`` is one rank of a parallel run and ``targets`` the ranks of a run of this world size
    that stand for it (``diff_parallel_groups``)."""
    world = len(targets)
    r_side = _Side(ref, skip_collectives=full_world is not None)
    t_sides = [_Side(t) for t in targets]
    mesh = _mesh(t_sides[0], world) if full_world is None else None  # a 2-D DeviceMesh DTensor declared
    _refuse_sub_groups(t_sides[0], full_world or world, mesh)
    _refuse_point_to_point([r_side, *t_sides])
    owner = _micro_batches(r_side, t_sides)  # a micro-batch's op -> the rank whose ops it maps onto
    maps = []
    out = ParallelDiff(world, len(r_side.keys), 0, 0, micro_batches=world if owner else 0)
    for rank, side in enumerate(t_sides):
        keys = [k for k in r_side.keys if owner.get(k.index, rank) == rank]  # what this rank stands for
        al = align(keys, side.keys)
        m = _follow_data(ref, r_side, side, dict(al.pairs), {k.index for k in keys} if owner else set())
        maps.append(m)
        mine = set(m.values())
        out.layout_ops.update(op.name for j, op in side.ops.items() if j not in mine and not aten.is_marker(op.name))
    declared = [_declared(side) for side in t_sides]  # DTensor's placements on each rank, where recorded
    departed: set[int] = set()  # reference ops that part from the reference, the first and what inherits it
    drawn: set[int] = set()  # random ops, and ops that part only because they read what random ops drew
    seen_inputs: set = set()
    step_views: set[int] = set()
    first: tuple[MappedOp, Mapped, Departure, str] | None = None
    within: ParallelDeparture | None = None  # after inputs that differ: the first op that parts with agreeing inputs
    differing: set[int] = set()  # the versions of the step's inputs that map under no layout at factor 1
    carriers: set[int] = set()  # reference ops that read, through the data flow, what a differing step input made
    by_ref: dict[int, MappedOp] = {}  # the ops mapped so far, by reference op number
    inherited = 0
    # The factor of the loss the backward differentiates: that of the last partial value the forward made before
    # it (a per-rank mean: 1/world; a summed loss: 1); none (a loss every rank computes whole): 1. Not simply the
    # last forward value: backward() makes the gradient's seed (ones_like) first, recorded in the forward.
    last_forward: Fraction | None = None
    loss: Fraction | None = None
    in_backward = False
    for n, i in enumerate(sorted(r_side.ops)):
        if progress is not None and n % 64 == 63:
            progress(64)
        if i in r_side.skipped:
            continue
        if differing:
            # it descends, through the reference's data flow, from a step input that differs (or an op that parted)
            made_by = ref.producers(i)
            if any(p is not None and (p in carriers or p in departed) for p in made_by.values()) or \
                    any(made_by.get(pos) is None and r.version in differing
                        for pos, r in enumerate(r_side.ops[i].inputs())):
                carriers.add(i)
        own = [owner[i]] if i in owner else list(range(world))  # the ranks whose ops stand for it
        if own == [-1] or not all(i in maps[r] for r in own):
            out.not_aligned.append(i)
            continue
        out.aligned += 1
        rop = r_side.ops[i]
        tops = [t_sides[r].ops[maps[r][i]] for r in own]
        tgts = [targets[r] for r in own]
        micro = owner.get(i)
        random = aten.is_random(rop.name)
        producers = ref.producers(i)
        # a view of the step's inputs or of a collective's buffer on a reference rank: ``tensor_split(x, world)``
        # cuts every rank's slice of the batch, which the target's ranks cut otherwise (and the trace's data flow
        # links each slice to the one before it): its inputs are compared, its outputs where an op that computes
        # reads them
        # (a batch drawn inside the step, by a random op every rank runs alike, is cut the same way)
        step_view = full_world is not None and aten.is_cheap(rop.name) and \
            all(p is None or p in step_views or p in r_side.skipped or aten.is_random(r_side.ops[p].name)
                for p in producers.values())
        if step_view:
            step_views.add(i)
        # a view of the batch (a step input, or a draw in the step) that no op of the reference reads
        # (``tensor_split(x, 1)[0]``: the single process's one piece is the whole tensor, and what reads it reads
        # that): a cut the ranks make otherwise, judged where an op that computes reads what the ranks cut
        unread_view = aten.is_cheap(rop.name) and not any(ref.consumers(i).values()) and \
            all(p is None or aten.is_random(r_side.ops[p].name) for p in producers.values())
        from_departed = [p for p in producers.values() if p is not None and p in departed]
        from_drawn = [p for p in producers.values() if p is not None and p in drawn]
        tensors: list[Mapped] = []
        # the step's inputs this op reads first (parameters, the batch): each storage once
        r_ins, t_ins = rop.inputs(), [t.inputs() for t in tops]
        out_arg = rop.kwargs.get("out")  # a buffer the op writes without reading it (DDP's bucket)
        for pos, rref in enumerate(r_ins):
            if producers.get(pos) is not None or rref.version in seen_inputs or \
                    (isinstance(out_arg, TensorRef) and rref.version == out_arg.version):
                continue
            if any(pos >= len(ti) or tgts[k].producers(tops[k].index).get(pos) is not None
                   for k, ti in enumerate(t_ins)):
                continue  # on some rank the op reads what a rank's own op made (a slice of the batch, a copy)
            seen_inputs.add(rref.version)
            m = _map(ref, tgts, rref, [ti[pos] for ti in t_ins], "in", pos, world, micro,
                     declared[own[0]].get((tops[0].index, pos)), mesh)
            if m is not None:
                tensors.append(m)
        r_outs, t_outs = rop.outputs_refs(), [t.outputs_refs() for t in tops]
        for pos, rref in enumerate(r_outs):
            if step_view or unread_view or any(pos >= len(to) for to in t_outs):
                continue
            m = _map(ref, tgts, rref, [to[pos] for to in t_outs], "out", pos, world, micro,
                     _declared_output(t_sides[own[0]], declared[own[0]], tops[0].index, pos), mesh)
            if m is not None:
                tensors.append(m)
        fwd = r_side.ops.get(rop.forward_index) if rop.phase == "backward" and rop.forward_index is not None else None
        mop = MappedOp(i, tuple(t.index for t in tops), rop.name, rop.module, rop.phase,
                       fwd.source if fwd is not None and fwd.source else rop.source, tuple(tensors),
                       () if micro is None else (micro,))
        out.ops.append(mop)
        by_ref[i] = mop
        if random:
            out.random_ops += 1
            if not tensors or any(m.layout is None or m.layout.factor != 1 for m in tensors):
                # each rank drew its own numbers: what reads them is judged only if it maps anyway
                drawn.add(i)
                if micro is None and _same_draws(ref, rop, tops, tgts):
                    out.same_draws.append(i)
                continue
            # every rank drew what the single process drew (one seed, a batch drawn in the step): compared as any op
        if not tensors:
            if r_outs and not any(r.stored for r in r_outs):
                out.not_stored += 1
            continue
        out.compared += 1
        if rop.phase == "backward" and not in_backward:
            in_backward, loss = True, last_forward
        elif rop.phase == "forward" and aten.reads_values(rop.name):  # not ones_like: backward()'s seed
            in_backward = False
            # the op's value (its first output; others are auxiliary, such as nll_loss's count) if it is partial
            # (a value every rank holds whole, such as a loss of the whole batch, is replicated, though half of it
            # on each of 2 ranks would be a partial one as well)
            value = next((m for m in tensors if m.kind == "out"), None)
            if value is not None and value.fits and value.fits[0].factor == 1 and \
                    value.fits[0].kind is LayoutKind.REPLICATED:
                last_forward = Fraction(1)
            else:
                partial_fit = None if value is None else next(
                    (f for f in value.fits if f.kind is LayoutKind.PARTIAL), None)
                if partial_fit is not None:
                    last_forward = partial_fit.factor
        tensors = [_pick(m, rop.phase if m.kind == "out" else None, loss) for m in tensors]
        mop = dataclasses.replace(mop, tensors=tuple(tensors))
        out.ops[-1] = by_ref[i] = mop
        bad = [m for m in tensors if m.layout is None or m.layout.factor not in _legit_factors(
            m.layout, rop.phase if m.kind == "out" else None, loss)]
        for m in tensors:
            if m.layout is not None and m.kind == "out":
                out.families.setdefault(rop.phase or "?", Counter())[_family(m.layout, m not in bad)] += 1
            if m.error is not None and m.layout is not None and m not in bad:
                out.worst = max(out.worst, m.error)
        if not bad:
            continue
        if from_drawn and not from_departed:  # it reads another rank's dropout mask than the reference's
            drawn.add(i)
            out.random_parted.append(i)
            continue
        # the step's inputs already differ (the first departure is of kind inputs): an op that parts reading none
        # of what they made, and no differing input itself, parts with agreeing inputs, as the rank-by-rank diff
        # names it; the first such is said as well
        with_agreeing = first is not None and first[2] is Departure.INPUTS and within is None and \
            i not in carriers and not any(m.kind == "in" for m in bad)
        for m in bad:
            if m.kind == "in":
                differing.add(r_ins[m.position].version)
                carriers.add(i)
        if not from_departed and (first is None or with_agreeing) and all(m.layout is None for m in bad) and \
                _amplifies(rop, tops, tensors, producers, by_ref, tgts, set(out.amplified), maps[own[0]]):
            # every rank computes from the same inputs, right given them; they differ from the reference's by a
            # reordered sum's rounding, which this op amplifies (AdamW's first update of a near-zero gradient)
            out.amplified.append(i)
            continue
        departed.add(i)
        out.parted.add(i)
        if (first is not None or from_departed) and not with_agreeing:
            inherited += first is not None
            continue
        m = bad[0]
        partial_in = _partial_input(producers, by_ref)
        if m.kind == "in" and m.offsets is None:
            kind, why = Departure.INPUTS, _why_inputs(m, rop.step)
        elif partial_in is not None and rop.phase == "optimizer" and \
                (over := _reduced_at(partial_in[0], rop, tops, tgts, t_sides[own[0]], maps[own[0]], ref, world,
                                     micro, mesh)) is not None:
            # the gradient went through its all-reduce, and came out whole on every rank at a factor
            (c, name, at), times = over
            line = t_sides[own[0]].ops[c].source
            kind, why = Departure.SCALED, (
                f"input {partial_in[0]} (the gradient) is replicated at {times}x the reference after {name} #{c} (on "
                f"rank {own[0]}{', ' + line if line else ''}): a sum not divided by the world size, or a loss scaled "
                f"twice")
        elif partial_in is not None and rop.phase == "optimizer":
            made = r_side.ops[partial_in[2]]
            where = ", ".join(x for x in (made.module or "no module", made.phase) if x)
            kind, why = Departure.UNREDUCED, (
                f"input {partial_in[0]} is partial over {world} ranks (each rank's own gradient, made by "
                f"#{partial_in[2]} {made.name}, {where}) and reaches the optimizer without its all-reduce: each rank "
                f"steps with its own")
        elif m.layout is not None:
            kind, why = Departure.SCALED, _why_scaled(m.layout, _legit_factors(m.layout, rop.phase, loss))
        elif partial_in is not None and \
                (ahead := _collective_ahead(t_sides[own[0]], maps[own[0]], tops[0].index)) is not None:
            # the reduction is there, after this op: what the op combines with the partial sums is summed too
            c, name = ahead
            line = t_sides[own[0]].ops[c].source
            kind, why = Departure.UNREDUCED, (
                f"input {partial_in[0]} holds partial sums over {world} ranks (the reference is their "
                f"{'average' if partial_in[1].factor != 1 else 'sum'}, made by #{partial_in[2]}), and this op runs "
                f"on them before {name} #{c} (on rank {own[0]}{', ' + line if line else ''}) reduces its result: it "
                f"needs the whole sum (a value every rank adds, such as a bias, is then summed {world} times); this op "
                f"belongs after the reduction")
        elif partial_in is not None:
            kind, why = Departure.UNREDUCED, (
                f"input {partial_in[0]} holds partial sums over {world} ranks (the reference is their "
                f"{'average' if partial_in[1].factor != 1 else 'sum'}, made by #{partial_in[2]}) and is used without "
                f"a reduction: an all-reduce is missing before this op")
        elif m.offsets is not None:
            dim, at = m.offsets
            spans = sorted(zip(at, m.sizes or ()))
            overlap = any(a + n > b for (a, n), (b, _) in zip(spans, spans[1:]))
            what = "slices that overlap (some of it on two ranks, some on none)" if overlap else \
                "not in rank order: a shard taken at the wrong offset"
            kind, why = Departure.SHARD_OFFSET, (
                f"{'input' if m.kind == 'in' else 'output'} {m.position} ({m.describe}): each rank holds a slice of the "
                f"reference on dim {dim}, at offsets {', '.join(f'rank {r}: {o}' for r, o in enumerate(at))}: {what}")
        elif m.off and len(m.off) < world and micro is None:
            held = [r for r in range(world) if r not in m.off]
            kind, why = Departure.NO_LAYOUT, (
                f"output {m.position} ({m.describe}): rank{'s' if len(held) > 1 else ''} "
                f"{', '.join(map(str, held))} hold{'s' if len(held) == 1 else ''} the reference's value, rank"
                f"{'s' if len(m.off) > 1 else ''} {', '.join(map(str, m.off))} "
                f"{'do' if len(m.off) > 1 else 'does'} not: this op went wrong there")
        elif (own_in := _made_apart(producers, tops[0], tgts[0], t_sides[own[0]], maps[own[0]], r_side,
                                    set(out.not_aligned))) is not None:
            pos, made, theirs = own_in
            kind, why = Departure.NO_LAYOUT, (
                f"output {m.position} ({m.describe}) maps onto the reference's under no layout (replicated, sharded "
                f"on a dimension, or partial over {world} ranks, at any simple factor): input {pos} is made on the "
                f"ranks by ops of their own, last {made}, where the reference runs {theirs} (not run by every rank), "
                f"with no collective on the way: if the reference's value is a sum over the ranks (a row-parallel "
                f"layer's output), its all-reduce is missing there")
        else:
            kind, why = Departure.NO_LAYOUT, (
                f"output {m.position} ({m.describe}) maps onto the reference's under no layout (replicated, sharded "
                f"on a dimension, or partial over {world} ranks, at any simple factor): the ranks compute something "
                f"else here (per-rank statistics that should be global, such as BatchNorm's without SyncBatchNorm or "
                f"means over shards of unequal size averaged as if equal; a different input)")
        if with_agreeing:
            within = ParallelDeparture(mop, m, kind, why, 0, step=rop.step)
            continue
        out.batch_warning = _batch_warning(rop, m, kind, {k: None if owner.get(p) == -1 else p
                                                          for k, p in producers.items()})
        behind = _collective_behind(t_sides[own[0]], maps[own[0]], tops[0].index)
        if behind is not None and kind in (Departure.SCALED, Departure.NO_LAYOUT) and behind[1] not in why:
            why += f"; on the ranks it reads what {behind[1]} (#{behind[0]} on rank {own[0]}) made, which the " \
                   f"single process does not run"
        elif kind is Departure.SCALED:
            # a scale the ranks apply in an op the reference does not run (a loss multiplied by the world size where
            # the reference divides by the micro-batch count, or multiplies by its own world size): its line
            extra = _computing_behind(t_sides[own[0]], maps[own[0]], tops[0].index)
            if extra is not None:
                why += f"; on the ranks it reads what {extra} made, which the reference does not run"
        first = (mop, m, kind, why)
    if progress is not None:
        progress(len(r_side.ops) % 64)
    computing = [i for i in out.not_aligned if not aten.is_cheap(r_side.ops[i].name)]
    out.ref_only.update(r_side.ops[i].name for i in computing)
    if len(computing) * 4 > out.ref_ops and not cut_short:  # (a side cut short lacks ops too: said by the caller)
        # not the same program on every rank as in the single process: no verdict on a mapping of what is left
        raise UsageError(
            f"the single process runs {len(computing)} of its {out.ref_ops} ops with no counterpart on every rank "
            f"(first #{computing[0]} {r_side.ops[computing[0]].name}): another program than each rank's, which is "
            f"not mapped onto the ranks; diff one rank op by op with --rank N")
    if first is not None:
        step = r_side.ops[first[0].ref].step
        out.departure = ParallelDeparture(first[0], first[1], first[2], first[3], inherited,
                                          earlier_step(step) if first[2] is Departure.INPUTS else None, step)
        out.within = within
    out.ref_layout_ops.update(r_side.ops[i].name for i in r_side.skipped if _makes_layout(r_side.ops[i].name))
    if any(declared):
        said = [t.layout_from for op in out.ops for t in op.tensors if t.layout_from is not None]
        out.from_placements = (said.count("placements"), said.count("inferred"))
    return out


def same_program(single: RankTrace, rank: RankTrace) -> bool:
    """Whether one rank of a parallel run runs the single process's program: all but a quarter of the single
    process's computing ops align with the rank's (the test ``diff_parallel`` refuses a mapping by)."""
    a, b = _Side(single), _Side(rank)
    paired = {i for i, _ in align(a.keys, b.keys).pairs}
    computing = [k.index for k in a.keys if not aten.is_cheap(a.ops[k.index].name)]
    return bool(computing) and sum(i not in paired for i in computing) * 4 <= len(a.keys)


def is_parallel_groups(ref_world: int, ref_ranks: list[int], target_world: int, target_ranks: list[int]) -> bool:
    """A parallel reference against every rank of a job of a world size it divides (2 ranks against 4)."""
    return 1 < ref_world < target_world and target_world % ref_world == 0 and \
        ref_ranks == list(range(ref_world)) and target_ranks == list(range(target_world))


def diff_parallel_groups(refs: list[RankTrace], targets: list[RankTrace],
                         progress: Callable[[int], None] | None = None, cut_short: bool = False) -> ParallelDiff:
    """A run of R ranks against one of W (R divides W) on the same global batch: rank q of the reference holds
    the share of the batch that ranks q*m to q*m+m-1 (m = W/R) hold between them (each slice cut in rank order),
    so each reference rank is diffed as a single process against those m ranks, its own collectives left out (they
    rejoin its layout: after them it holds what the target's ranks hold after theirs)."""
    rw, world = len(refs), len(targets)
    m = world // rw
    fsdp = next((op for op in refs[0] if aten.namespace(op.name) == "fsdp"), None)
    if fsdp is not None:
        raise UsageError(
            f"a {rw}-rank run against a {world}-rank run with FSDP ({fsdp.name}, #{fsdp.index} on rank 0) is not "
            f"mapped: each world size packs its shards into flat buffers of its own; diff each against a "
            f"single-process run of the same script, or compare one rank op by op with --rank N")
    groups = []
    for q, ref in enumerate(refs):
        g = diff_parallel(ref, targets[q * m:(q + 1) * m], progress, cut_short, full_world=world)
        ops = {op.ref: dataclasses.replace(op, ranks=tuple(q * m + r for r, _ in op.on_ranks()), ref_rank=q)
               for op in g.ops}
        g.ops = list(ops.values())
        if g.departure is not None:
            g.departure = dataclasses.replace(g.departure, op=ops[g.departure.op.ref])
        groups.append(g)
    out = ParallelDiff(world, sum(g.ref_ops for g in groups), sum(g.aligned for g in groups),
                       sum(g.compared for g in groups), ref_world=rw, groups=groups)
    for g in groups:
        out.not_aligned += g.not_aligned
        out.layout_ops.update(g.layout_ops)
        out.ref_layout_ops.update(g.ref_layout_ops)
        out.ref_only.update(g.ref_only)
        for phase, c in g.families.items():
            out.families.setdefault(phase, Counter()).update(c)
        out.random_ops += g.random_ops
        out.not_stored += g.not_stored
        out.worst = max(out.worst, g.worst)
        out.ops += g.ops
        out.random_parted += g.random_parted
        out.same_draws += g.same_draws
        out.amplified += g.amplified
    out.batch_warning = next((g.batch_warning for g in groups if g.batch_warning), None)
    said = [g.from_placements for g in groups if g.from_placements is not None]
    if said:
        out.from_placements = (sum(n for n, _ in said), sum(m for _, m in said))
    parted = [g for g in groups if g.departure is not None]
    if parted:  # the reference rank that parts first in its op order (every reference rank runs the same program)
        g = min(parted, key=lambda g: g.departure.op.ref)
        out.departure = g.departure
        out.within = g.within
    return out


def _amplifies(rop: OpRecord, tops: list[OpRecord], tensors: list[Mapped], producers: dict[int, int | None],
               by_ref: dict[int, MappedOp], ranks: list[RankTrace], amplified: set[int], aligned0: dict[int, int]) -> bool:
    """Whether an op's outputs part from the reference's only by amplifying a rounding difference of its inputs:
    every input it reads is replicated at factor 1 (as mapped: from an earlier aligned op, or from outside the step),
    every rank's outputs have the reference's shapes, and every rank's op, replayed alone from its own recorded
    inputs, is right. Then each rank computed the reference's op from the reference's values up to rounding."""
    mine = ranks[0].producers(tops[0].index)
    for pos, p in producers.items():
        if mine.get(pos) != (None if p is None else aligned0.get(p)):
            return False  # on rank 0 the input comes from an op of its own (a collective): not the reference's value
        if p is None or p in amplified:  # an amplified value: every rank holds it alike, as its maker made sure
            continue
        made = by_ref.get(p)
        lay = None if made is None else next((t.layout for t in made.tensors if t.kind == "out"), None)
        if lay is None or lay.kind is not LayoutKind.REPLICATED or lay.factor != 1:
            return False
    if any(t.kind == "in" and (t.layout is None or t.layout.kind is not LayoutKind.REPLICATED or t.layout.factor != 1)
           for t in tensors):
        return False
    shapes = [r.shape for r in rop.outputs_refs()]
    if any([r.shape for r in top.outputs_refs()] != shapes for top in tops):
        return False  # a rank holds a part of the reference's value, not all of it
    from replaydiff.replay.policy import ReplayOptions
    from replaydiff.replay.result import Status
    from replaydiff.replay.runner import OpReplayer

    opts = ReplayOptions(device="cpu", precision="fp64")
    try:
        return all(OpReplayer(rt, opts).replay(top).status is Status.OK for rt, top in zip(ranks, tops))
    except Exception:  # an op replay cannot run: no evidence that it is right
        return False


def _declared(side: _Side) -> dict[tuple[int, int], DTensorArg]:
    """{(op number, input position): placements} DTensor declared on this rank (empty: none recorded)."""
    notes = side.notes
    return declared_inputs(notes, (side.ops[i] for i in sorted(side.ops))) if notes else {}


def _declared_output(side: _Side, declared: dict[tuple[int, int], DTensorArg], index: int,
                     pos: int) -> DTensorArg | None:
    """The placements DTensor declared for output ``pos`` of a rank's op: those of the first later op that reads
    it as a DTensor argument (DTensor says how an op's result is laid out when the next op takes it)."""
    if not declared:
        return None
    for c in side.trace.consumers(index).get(pos, []):
        for q, p in side.trace.producers(c).items():
            if p == index and (c, q) in declared:
                return declared[(c, q)]
    return None


def _declares(arg: DTensorArg, layout: Layout) -> bool:
    """Whether DTensor's placements on a one-dimensional mesh of the ranks are this layout."""
    kind, dim = arg.placement()
    if arg.mesh != (layout.world,) or layout.micro_batch is not None:
        return False
    if kind is Placement.SHARD:
        return layout.kind is LayoutKind.SHARDED and layout.dim == dim and layout.blocks == 1
    if kind is Placement.REPLICATE:
        return layout.kind is LayoutKind.REPLICATED
    return kind is Placement.PARTIAL and layout.kind is LayoutKind.PARTIAL


def _backward_passes(side: _Side) -> list[int]:
    """The last op of each run of backward ops, in order: one per forward-backward pass (micro-batch)."""
    ends: list[int] = []
    inside = False
    for k in side.keys:
        back = side.ops[k.index].phase == "backward"
        if back:
            if inside:
                ends[-1] = k.index
            else:
                ends.append(k.index)
        inside = back
    return ends


def _micro_batches(r_side: _Side, t_sides: list[_Side]) -> dict[int, int]:
    """When the single process runs the global batch as gradient-accumulation micro-batches, one per rank, each
    rank one pass: {op of micro-batch r: r} for every op up to the last backward (a micro-batch's ops run from the
    end of the previous one's backward to the end of its own); the ops after it (the optimizer step) are every
    rank's. The ops micro-batch 0 runs before its first op that micro-batch 1 runs too (the whole batch taken,
    before it is cut into micro-batches) are no rank's: -1. Empty when the reference runs as many passes as each rank. A
    UsageError for any other count."""
    ends = _backward_passes(r_side)
    theirs = {len(_backward_passes(t)) for t in t_sides}
    if len(ends) <= 1 or theirs == {len(ends)} or len(ends) < max(theirs):
        return {}
    world = len(t_sides)
    if theirs != {1} or len(ends) != world:
        raise UsageError(
            f"the single process runs {len(ends)} forward-backward passes (gradient-accumulation micro-batches) and "
            f"each of the {world} ranks {'/'.join(map(str, sorted(theirs)))}: rank r's slice is mapped onto micro-batch "
            f"r only when there are as many micro-batches as ranks, each rank running one pass; diff one rank op by op "
            f"with --rank N")
    owner: dict[int, int] = {}
    r = 0
    for k in r_side.keys:
        if k.index > ends[-1]:
            break
        owner[k.index] = r
        if k.index == ends[r]:
            r += 1
    # by shapes: the micro-batches' ops have the same ones, which the whole batch's do not
    keys = [[op_keys(r_side.ops[k.index]) for k in r_side.keys if owner.get(k.index) == r] for r in (0, 1)]
    common = align(keys[0], keys[1]).pairs
    start = min((a for a, _ in common), default=keys[0][0].index)
    for k in keys[0]:
        if k.index < start:
            owner[k.index] = -1
    return owner


def _mesh(side: _Side, world: int) -> tuple[tuple[tuple[int, ...], ...], ...] | None:
    """The rows and the columns of the two-dimensional DeviceMesh over every rank that DTensor declared (rank
    d*T + t at row d, column t, as ``init_device_mesh`` lays them out), or None: none recorded."""
    for note in side.notes:
        for a in note.args:
            if a is not None and len(a.mesh) == 2 and a.mesh[0] * a.mesh[1] == world:
                rows, cols = a.mesh
                return (tuple(tuple(d * cols + t for t in range(cols)) for d in range(rows)),
                        tuple(tuple(d * cols + t for d in range(rows)) for t in range(cols)))
    return None


def _refuse_point_to_point(sides: list[_Side]) -> None:
    """A UsageError when a rank sends or receives point to point: pipeline stages, each rank running other layers
    than the others, which a mapping of every rank's ops onto the single process's would misread."""
    for side in sides:
        for op in side.ops.values():
            if aten.is_point_to_point(op.name):
                raise UsageError(
                    f"rank {side.trace.rank}'s #{op.index} {op.name} sends or receives point to point: pipeline "
                    f"stages, each rank running other layers, are not mapped onto the single process; replay each "
                    f"run (replay checks each send against its receive), or diff one rank op by op with --rank N")


def _refuse_sub_groups(side: _Side, world: int, mesh: tuple[tuple[tuple[int, ...], ...], ...] | None = None) -> None:
    """A UsageError when the ranks' collectives run over groups of some of them: a mesh of more than one
    dimension (FSDP x TP, pipeline stages), whose values this mapping over one dimension of ranks would misread;
    unless the group is a row or a column of the two-dimensional ``mesh`` DTensor declared."""
    lines = set() if mesh is None else {g for grouping in mesh for g in grouping}
    for op in side.ops.values():
        info = op.collective
        if info is not None and info.ranks and 1 < len(info.ranks) < world and tuple(sorted(info.ranks)) not in lines:
            raise UsageError(
                f"the ranks' collectives run over groups of some of them (#{op.index} {op.name} over ranks "
                f"{list(info.ranks)} of {world}): a mesh of more than one dimension (FSDP x TP, pipeline stages), "
                f"which is not mapped onto the single process yet; diff one rank op by op with --rank N")


def _follow_data(ref: RankTrace, r_side: _Side, side: _Side, pairs: dict[int, int],
                 free: set[int] = frozenset()) -> dict[int, int]:
    """The alignment corrected by the data flow: when the op a rank's counterpart of reference op ``c`` reads an
    input from is not the counterpart of the reference's producer of that input, but an op of the same name the
    rank runs on its own, that op is the counterpart. A rank that splits the batch into every rank's piece
    (``tensor_split(x, world)[rank]``) runs one slice per rank; the one it reads is its counterpart of the single
    process's slice, which the alignment by position alone pairs with the first. An op of ``free`` the alignment
    left unpaired is paired the same way (a micro-batch's slice of the labels, taken where the rank takes its slices
    of the whole batch before the forward)."""
    taken = set(pairs.values())
    for _ in range(4):  # to a fixed point: a correction can free the op an earlier one wanted
        moved = False
        for c in sorted(pairs):
            rp = ref.producers(c)
            tp = side.trace.producers(pairs[c])
            for pos, p in rp.items():
                q = tp.get(pos)
                if p is None or q is None or pairs.get(p) == q or q in taken or (p not in pairs and p not in free):
                    continue
                if side.ops.get(q) is None or side.ops[q].name != r_side.ops[p].name:
                    continue
                taken.discard(pairs.get(p))
                pairs[p] = q
                taken.add(q)
                moved = True
        moved = _follow_readers(ref, r_side, side, pairs, taken) or moved
        if not moved:
            break
    return pairs


def _follow_readers(ref: RankTrace, r_side: _Side, side: _Side, pairs: dict[int, int], taken: set[int]) -> bool:
    """The same correction from the other end: a reference op whose counterpart does not read the counterparts of
    what it reads (or that has none) is paired with the one op of its name and phase that does, read for read; if
    another reference op held that op without reading as it does, the two swap. The backward of a Linear with its
    bias runs as one ``addmm``'s on one process and as ``mm``'s then the bias's on each rank (a row-parallel layer):
    the same ``t`` and ``mm`` ops in another order, which the alignment by position pairs crosswise (the weight's
    transpose with the gradient's, both of one shape)."""
    owner = {j: c for c, j in pairs.items()}

    def known(c: int) -> list[tuple[int, int]]:
        """(input position, the counterpart of its producer) for each input of ``c`` whose producer is paired."""
        return [(pos, pairs[p]) for pos, p in ref.producers(c).items() if p is not None and p in pairs]

    def reads_as(j: int, reads: list[tuple[int, int]]) -> bool:
        """Whether ``j`` reads what ``reads`` says (at least one input known, none other)."""
        tp = side.trace.producers(j)
        return bool(reads) and all(tp.get(pos) == q for pos, q in reads)

    moved = False
    for c in sorted(r_side.ops):
        rop = r_side.ops[c]
        reads = known(c)
        if c in r_side.skipped or not reads or (c in pairs and reads_as(pairs[c], reads)):
            continue
        found = {j for _, q in reads for readers in side.trace.consumers(q).values() for j in readers
                 if side.ops.get(j) is not None and side.ops[j].name == rop.name and side.ops[j].phase == rop.phase
                 and reads_as(j, reads)}
        if len(found) != 1:
            continue
        j = found.pop()
        other = owner.get(j)
        if other is not None and reads_as(j, known(other)):
            continue  # held by the op it belongs to
        mine = pairs.get(c)
        if other is not None:  # the other takes what this one held (or nothing); it is checked again next pass
            if mine is not None:
                pairs[other] = mine
                owner[mine] = other
            else:
                del pairs[other]
        elif mine is not None:
            taken.discard(mine)
            del owner[mine]
        taken.add(j)
        pairs[c] = j
        owner[j] = c
        moved = True
    return moved


def _map(ref: RankTrace, targets: list[RankTrace], rref: TensorRef, trefs: list[TensorRef], kind: str,
         pos: int, world: int, micro: int | None = None, declared: DTensorArg | None = None,
         mesh: tuple[tuple[tuple[int, ...], ...], ...] | None = None) -> Mapped | None:
    """How the ranks hold one tensor of an aligned op; None when it cannot be compared (no data, uninitialised).
    ``micro``: one rank's op against the reference's micro-batch of that number (``targets`` is that rank alone)."""
    if not rref.stored or rref.meta or rref.uninitialised or not all(t.stored and not t.meta for t in trefs):
        return None
    r = ref.tensor(rref)
    parts = [targets[k].tensor(t) for k, t in enumerate(trefs)]
    fits = infer_layouts(r, parts, close_for(r.dtype))
    if mesh is not None and micro is None:
        # a value every rank holds whole, or a slice of, first; then the layouts within the mesh's rows or columns,
        # before a sum over every rank (a per-rank mean over the mesh's data-parallel dimension is partial over its
        # rows, at 1/rows, not over all the ranks: the backward's factor follows from it)
        flat = [f for f in fits if f.kind in (LayoutKind.REPLICATED, LayoutKind.SHARDED)]
        fits = flat + infer_mesh_layouts(r, parts, close_for(r.dtype), mesh) + [f for f in fits if f not in flat]
    if micro is not None:
        fits = [dataclasses.replace(f, world=world, micro_batch=micro) for f in fits]
    elif declared is not None:  # what DTensor declared first, when it fits; the plainest otherwise
        fits = sorted(fits, key=lambda f: not _declares(declared, f))
    layout = fits[0] if fits else None
    eps = torch.finfo(r.dtype).eps if r.dtype.is_floating_point else 1.0
    error = None if layout is None else _rel_l2(layout, parts, r) / eps
    off: tuple[int, ...] = ()
    offsets = None
    if layout is None:
        close = close_for(r.dtype)
        if all(tuple(p.shape) == tuple(r.shape) for p in parts):
            off = tuple(k for k, p in enumerate(parts) if not close(p.to(torch.float64), r))
        found = None if micro is not None else shard_offsets(r, parts, close)
        offsets = None if found is None else (found[0], tuple(found[1]))
    sizes = None if offsets is None else tuple(int(p.shape[offsets[0]]) for p in parts)
    return Mapped(kind, pos, rref.describe(), layout, error, off, offsets, tuple(fits), sizes,
                  None if micro is not None else declared)


def _own_producer(side: _Side, aligned: dict[int, int], index: int, stop: Callable[[OpRecord], bool],
                  limit: int = 32, ahead: bool = False) -> int | None:
    """The nearest op matching ``stop`` that a rank's op reads from through ops the single process does not run (its
    inputs' producers, walked back breadth first while they are the rank's own ops). ``ahead``: the nearest that
    reads the op's output instead, walked forward through the rank's own ops, views and copies (a clone before an
    in-place all-reduce)."""
    mine = set(side.ops) - set(aligned.values())
    todo, seen = [index], {index}
    while todo and len(seen) <= limit:
        i = todo.pop(0)
        near = [j for readers in side.trace.consumers(i).values() for j in readers] if ahead else \
            side.trace.producers(i).values()
        for p in near:
            if p is None or p in seen or p not in side.ops or (not ahead and p not in mine):
                continue
            if stop(side.ops[p]):
                return p
            if p in mine or (ahead and (aten.is_cheap(side.ops[p].name) or side.ops[p].name in _COPIES)):
                seen.add(p)
                todo.append(p)
    return None


_COPIES = frozenset({"aten.clone.default", "aten._to_copy.default", "aten.copy_.default"})


def _collective_ahead(side: _Side, aligned: dict[int, int], index: int) -> tuple[int, str] | None:
    """The nearest collective that reduces what a rank's op made, through views, copies and the rank's own ops."""
    c = _own_producer(side, aligned, index, lambda op: aten.is_collective(op.name), limit=8, ahead=True)
    return None if c is None else (c, side.ops[c].name)


def _collective_behind(side: _Side, aligned: dict[int, int], index: int) -> tuple[int, str] | None:
    """The nearest collective a rank's op reads from through ops the single process does not run."""
    p = _own_producer(side, aligned, index, lambda op: aten.is_collective(op.name))
    return None if p is None else (p, side.ops[p].name)


def _computing_behind(side: _Side, aligned: dict[int, int], index: int) -> str | None:
    """The nearest op that computes (not a view or copy) a rank's op reads from through ops the single process does
    not run, as 'name (#N on rank R, line)' (a backward op: the line of the forward op it belongs to)."""
    p = _own_producer(side, aligned, index, lambda op: not aten.is_cheap(op.name) and not aten.is_collective(op.name))
    if p is None:
        return None
    op = side.ops[p]
    fwd = side.ops.get(op.forward_index) if op.phase == "backward" and op.forward_index is not None else None
    line = fwd.source if fwd is not None and fwd.source else op.source
    where = "" if not line else f", {'the backward of ' if fwd is not None else ''}{line}"
    return f"{op.name} (#{p} on rank {side.trace.rank}{where})"


def _reduced_at(pos: int, rop: OpRecord, tops: list[OpRecord], tgts: list[RankTrace], side: _Side,
                aligned: dict[int, int], ref: RankTrace, world: int, micro: int | None,
                mesh) -> tuple[tuple[int, str, str | None], str] | None:
    """For an optimizer op's input that is partial as the reference's producer made it: when on the ranks it went
    through a collective (an all-reduce of the rank's own ops) and is whole on every rank at a factor other than 1,
    ((the collective's op number on the first rank, its name, its line), the factor as text); else None."""
    p = tgts[0].producers(tops[0].index).get(pos)
    if p is None or p in set(aligned.values()):
        return None
    op = side.ops.get(p)
    found = (p, op.name) if op is not None and aten.is_collective(op.name) else _collective_behind(side, aligned, p)
    if found is None or micro is not None:
        return None
    rref, trefs = rop.inputs()[pos], [t.inputs()[pos] for t in tops]
    m = _map(ref, tgts, rref, trefs, "in", pos, world, None, None, mesh)
    if m is None or m.layout is None or m.layout.kind is not LayoutKind.REPLICATED or m.layout.factor == 1:
        return None
    return (found[0], found[1], side.ops[found[0]].source), ratio_text(1 / m.layout.factor)


def _same_draws(ref: RankTrace, rop: OpRecord, tops: list[OpRecord], ranks: list[RankTrace]) -> bool:
    """Whether a random op's draws are the same on every rank where each rank holds a piece of the reference's
    (its shape is not the reference's): the same seed on every rank."""
    if len(tops) < 2:
        return False
    for pos, rref in enumerate(rop.outputs_refs()):
        trefs = [t.outputs_refs()[pos] if pos < len(t.outputs_refs()) else None for t in tops]
        if any(t is None or not t.stored or t.meta or t.uninitialised for t in trefs):
            continue
        if all(tuple(t.shape) == tuple(rref.shape) for t in trefs):
            continue  # every rank holds the whole draw: alike is right
        first = ranks[0].tensor(trefs[0])
        if first.numel() and all(tuple(t.shape) == tuple(first.shape) and torch.equal(r.tensor(t), first)
                                 for r, t in zip(ranks[1:], trefs[1:])):
            return True
    return False


def _made_apart(producers: dict[int, int | None], top: OpRecord, rank: RankTrace, side: _Side,
                aligned: dict[int, int], r_side: _Side, not_aligned: set[int]) -> tuple[int, str, str] | None:
    """The first input of an op that the reference makes with a computing op the ranks do not run, and the first
    rank makes with computing ops of its own, no collective among them (a row-parallel Linear run as one addmm on
    one process and as mm then the bias on each rank, its sum never reduced): (position, the rank's last op that
    computes it as 'name (#N on rank R, line)', the reference's as '#N name'); None otherwise."""
    mine = rank.producers(top.index)
    for pos, p in sorted(producers.items()):
        q = mine.get(pos)
        if p is None or q is None or p not in not_aligned or aten.is_cheap(r_side.ops[p].name):
            continue
        if q in set(aligned.values()) or aten.is_collective(side.ops[q].name) or \
                _collective_behind(side, aligned, q) is not None:
            continue
        op = side.ops[q]
        if aten.is_cheap(op.name):
            continue
        where = f", {op.source}" if op.source else ""
        return pos, f"{op.name} (#{q} on rank {side.trace.rank}{where})", f"#{p} {r_side.ops[p].name}"
    return None


def _partial_input(producers: dict[int, int | None],
                   by_ref: dict[int, MappedOp]) -> tuple[int, Layout, int] | None:
    """The first input of an op that a partial output of an earlier aligned op feeds: (position, layout, op)."""
    for pos, p in sorted(producers.items()):
        if p is None or p not in by_ref:
            continue
        for t in by_ref[p].tensors:
            if t.kind == "out" and t.layout is not None and t.layout.kind is LayoutKind.PARTIAL:
                return pos, t.layout, p
    return None


def _why_scaled(layout: Layout, legit: tuple[Fraction, ...]) -> str:
    right = min(legit, key=lambda f: abs(math.log(f / layout.factor)))
    times = right / layout.factor
    scale = ratio_text(times)
    powers = {Fraction(layout.world) ** k for k in range(-3, 4)}
    if times not in powers:  # no scale by the world size: the ranks' values are weighted otherwise
        return (f"{layout.describe()}: {scale}x what a correct parallel run holds here, a factor no scale by the "
                f"world size gives: per-rank values weighted differently from the reference's, such as means over "
                f"shards of unequal size averaged as if equal")
    return (f"{layout.describe()}: {scale}x what a correct parallel run holds here (a scale applied on every rank "
            f"that the single process does not apply: a loss or gradient scaled by the world size twice, or not "
            f"at all)")


def _batch_warning(rop: OpRecord, m: Mapped, kind: Departure, producers: dict[int, int | None]) -> str | None:
    """One line when where the runs part is the batch itself: a tensor from outside the step that needs no
    gradient, read in the forward, that maps under no layout (or a view of such tensors, the slice each rank takes,
    that does not): the ranks' batches joined are not the single process's. ``producers``: the whole batch taken
    before it is cut into micro-batches counts as from outside."""
    if rop.phase != "forward":
        return None
    ins = rop.inputs()
    op = f"ref #{rop.index} {rop.name} (forward)"
    if kind is Departure.INPUTS and not ins[m.position].requires_grad:
        what = f"input {m.position} ({m.describe}) of {op}, from outside the step and needing no gradient, is not " \
               f"the ranks' tensors joined in rank order"
    elif kind is Departure.NO_LAYOUT and aten.is_cheap(rop.name) and ins and \
            all(p is None for p in producers.values()) and not any(r.requires_grad for r in ins):
        what = f"what {op} takes of input 0 ({ins[0].describe()}), from outside the step and needing no gradient, " \
               f"is not the ranks' slices joined in rank order"
    else:
        return None
    return (f"the runs did not see the same global batch: {what}, nor the same on every rank: record both from the "
            f"same data, seed and global batch size")


def earlier_step(step: int | None) -> str | None:
    """At a step after the job's first, where the step's inputs differ: the line that says an earlier step may have
    parted the runs, and the command that finds it; None at step 1 or in a trace without step numbers."""
    if step is None or step <= 1:
        return None
    return (f"this is step {step}: an earlier step may have parted the runs (an optimizer amplifying a reordered "
            f"sum's rounding, such as Adam's update of a gradient that is zero up to rounding, or a bug that acts at "
            f"every step); to find it, record step 1 of both runs (replaydiff record --step 1) and diff those")


def _why_inputs(m: Mapped, step: int | None = None) -> str:
    at = "" if m.layout is None else f" ({m.layout.describe()})"
    head = (f"input {m.position} ({m.describe}) comes from outside the step and maps onto the reference's under no "
            f"layout at factor 1{at}")
    if earlier_step(step) is not None:
        return f"{head}: the runs had parted before step {step} (or began apart: initial weights, seed, global batch)"
    return f"{head}: the runs began apart (initial weights, seed, or not the same global batch)"
