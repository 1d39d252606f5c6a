"""How the ranks of a parallel run hold one value of the single-process step: its layout, found from the tensors.

A data-, fully-sharded or tensor-parallel step holds each value of the single-process step in one of a few layouts
across its ranks:

- replicated: every rank holds the whole value (parameters under DDP, gradients after their all-reduce);
- sharded along a dimension: each rank holds a slice, in rank order, even or uneven (the batch under data
  parallelism, FSDP's parameter shards, column- and row-parallel weights and activations, sequence parallelism);
- partial: the sum over the ranks is the value (local gradients before their all-reduce, row-parallel outputs
  before theirs);

each of them up to a known factor: a per-rank mean over a slice of the batch is the reference's mean times the world
size over the ranks' average, so a value computed from it (a local gradient) is the reference divided by the world
size in sum. ``infer_layout`` tries the layouts the shapes allow, the plainest first (replicated, then sharded, then
partial), each at the simple factor (a ratio of small integers) that brings it closest to the reference, and
returns the first whose mapped value fits the reference by the caller's test of closeness, or None when none does:
the ranks' values cannot be the reference's in any layout. Which factors are right is the caller's to judge (a
per-rank mean gives 1/world; a gradient scaled twice gives 1/world of that).

Each kind is one registered class (``Kind``, ``KINDS``): how its parts join, its candidates, its fit, its words,
its factors and the DTensor placement that declares it; the layout ``Layout`` is the value that names one.

Pure functions of tensors: no trace, no tolerance policy (the caller's ``close`` decides), so the diff of a parallel
run against the single-process run, the step-input check and tests share one definition.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from typing import Callable, Sequence

import torch

Close = Callable[[torch.Tensor, torch.Tensor], bool]  # close(mapped value, reference) -> fits


class LayoutKind(str, Enum):
    REPLICATED = "replicated"
    SHARDED = "sharded"
    PARTIAL = "partial"
    MAX = "max"  # the largest over the ranks is the value (a per-rank max the program reduces with a max)
    MIN = "min"
    NORM = "norm"  # the 2-norm over the ranks' values is the value (each rank's norm of its shard: DTensor's _NormP)
    # expert parallelism: one rank alone holds the whole value (an expert's op, run where the expert is)
    HELD = "held"
    # expert parallelism: each rank holds its rows grouped by the rank they are sent to (an all-to-all's input), or by
    # the expert where a rank holds several, the reference the same rows grouped over every rank: block b of every
    # rank in rank order, then block b + 1
    ROUTED = "routed"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Layout:
    """How ``world`` ranks hold a value: the kind, the dimension split (sharded) with each rank's extent along it,
    and the factor the mapped value is multiplied by to give the reference (1: none)."""

    kind: LayoutKind
    world: int
    dim: int | None = None
    sizes: tuple[int, ...] | None = None
    factor: Fraction = Fraction(1)
    # sharded only: the dim holds ``blocks`` runs of every rank's slices in turn (a batch dim flattened with an outer
    # one: rows [S, B, D] viewed as [S*B, D] with B sharded hold each rank's rows in S interleaved blocks); 1: not
    blocks: int = 1
    # the value one rank holds alone: the reference ran the global batch as micro-batches, one per rank, and this
    # rank's op stands for the reference's op of micro-batch ``micro_batch`` (the rank's own number); None: not
    micro_batch: int | None = None
    # a two-dimensional mesh: the ranks fall into ``groups`` (a row or a column of the mesh each, in order), each
    # group holds its part in the ``inner`` layout, and this layout (over ``world`` = the number of groups) joins
    # the groups' parts; None: one dimension
    inner: "Layout | None" = None
    groups: tuple[tuple[int, ...], ...] | None = None
    # gradient accumulation on the ranks: the ``world`` parts are world/passes ranks' micro-batches, ``passes`` of
    # each rank in turn (rank-major); with ``micro_batch``, each rank's passes against as many micro-batches of the
    # reference; 1: one part per rank
    passes: int = 1
    # held: the rank that holds the value (the other ranks run no counterpart)
    holder: int | None = None
    # routed: each rank's blocks along ``dim`` (the rows it sends to each rank, in rank order; or to each expert)
    splits: tuple[tuple[int, ...], ...] | None = None
    # sharded only: the parts joined along ``dim`` are the reference's rows in another order, joined row i being
    # the reference's row ``order[i]`` (a batch a DistributedSampler dealt out interleaved); a dim of k times as
    # many positions (the batch flattened with the sequence) in runs of k; None: in order
    order: tuple[int, ...] | None = None

    def assemble(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The value the ranks' tensors stand for (before the factor), in float64: rank 0's for a replicated
        value, the slices joined in rank order for a sharded one, the sum for a partial one."""
        if self.inner is not None and self.groups is not None:
            held = [self.inner.assemble([parts[i] for i in g]) for g in self.groups]
            return dataclasses.replace(self, inner=None, groups=None).assemble(held)
        return KINDS[self.kind].assemble(self, [p.detach().to(torch.float64) for p in parts])

    def mapped(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The reference as the ranks hold it: ``assemble`` times the factor."""
        x = self.assemble(parts)
        return x if self.factor == 1 else x * float(self.factor)

    def describe(self) -> str:
        """e.g. 'sharded on dim 0 over 2 ranks (4+4)', 'partial over 2 ranks: the reference is their average',
        'replicated on 2 ranks at 2x the reference'."""
        if self.passes > 1 and self.micro_batch is None:
            plain = dataclasses.replace(self, passes=1).describe()
            return plain.replace(f" {self.world} ranks", f" {self.world // self.passes} ranks x {self.passes} "
                                                         f"micro-batches", 1)
        scale = "" if self.factor == 1 else f" at {ratio_text(1 / self.factor)}x the reference"
        if self.inner is not None and self.groups is not None:
            outer = dataclasses.replace(self, inner=None, groups=None).describe()
            outer = outer.replace(f" {self.world} ranks", f" {self.world} groups of ranks", 1)
            return f"{outer}, each group ({', '.join('/'.join(map(str, g)) for g in self.groups)}) holding its part " \
                   f"{self.inner.describe()}"
        if self.micro_batch is not None:
            which = f"micro-batch {self.micro_batch}" if self.passes == 1 else "micro-batch of the same rows"
            return f"rank {self.micro_batch}'s own value against the reference's {which}{scale}"
        return KINDS[self.kind].describe(self, scale)

    def to_json(self) -> dict:
        out = {"kind": self.kind.value, "world": self.world, "dim": self.dim,
               "sizes": None if self.sizes is None else list(self.sizes), "blocks": self.blocks,
               "factor": str(self.factor)}
        if self.micro_batch is not None:
            out["micro_batch"] = self.micro_batch
        if self.passes > 1:
            out["micro_batches_per_rank"] = self.passes
        if self.holder is not None:
            out["holder"] = self.holder
        if self.splits is not None:
            out["splits"] = [list(x) for x in self.splits]
        if self.order is not None:
            out["order"] = list(self.order)
        if self.inner is not None and self.groups is not None:
            out["inner"] = self.inner.to_json()
            out["groups"] = [list(g) for g in self.groups]
        return out


Splits = tuple[tuple[int, ...], ...]  # each rank's split sizes along dim 0 (an all-to-all's), in rank order


class Kind:
    """One layout kind, everything the diff knows of it: how the ranks' tensors join into the value (``assemble``),
    the layouts of its kind the shapes allow (``candidates``) and how one is fitted to a reference (``fit``: the
    simple factor, and whether a factor may scale it at all), its words (``describe``, ``name``, ``family``), the
    factors a correct run holds it at (``factors``) and the DTensor placement that declares it (``declared_by``).
    One registered subclass per kind (``KINDS``, in the order ``candidates`` tries them): a new way a parallel run
    holds a value is one class here."""

    kind: LayoutKind
    scaled = True  # whether the value may stand for the reference at a factor other than 1 (a sum of means)
    # whether the value is one rank's element at each position (a max, a min): it fits ranks of which some agree
    # with the reference and some hold less (a ReLU of values one rank got wrong), so a fit proves no agreement
    picks = False
    placement: str | None = None  # DTensor's placement that declares this kind (trace.placements.Placement's value)

    def assemble(self, layout: "Layout", xs: list[torch.Tensor]) -> torch.Tensor:  # xs: float64, one per rank
        raise NotImplementedError

    def describe(self, layout: "Layout", scale: str) -> str:
        raise NotImplementedError

    def name(self, layout: "Layout") -> str:
        """The kind in the summary's words, without a factor: 'replicated', 'sharded on dim 0'."""
        return layout.kind.value

    def family(self, layout: "Layout", legit: bool) -> str:
        """The summary line's name of a layout of this kind at its factor (``legit``: a factor a correct run has
        there, a per-rank mean's 1/world named for what it is)."""
        text = self.name(layout)
        if layout.factor == 1:
            return text
        return f"{text} (of a per-rank mean)" if legit and layout.factor == Fraction(1, layout.world) else \
            f"{text} at {ratio_text(1 / layout.factor)}x"

    def candidates(self, ref_shape: tuple[int, ...], shapes: list[tuple[int, ...]],
                   exchanges: Sequence[Splits]) -> list["Layout"]:
        """The layouts of this kind the shapes allow (``world`` = len(shapes) > 0), at factor 1."""
        return []

    def group_candidates(self, shapes: list[tuple[int, ...]]) -> list["Layout"]:
        """The layouts of this kind one group of a mesh's ranks can hold its part of a value in, with no reference
        to size them by (``infer_mesh_layouts``); none: the kind is not used within a group."""
        return []

    def group_holds(self, members: Sequence[torch.Tensor], close: Close) -> bool:
        """Whether one group's tensors hold a part in this kind, beyond their shapes."""
        return True

    def fit(self, layout: "Layout", ref: torch.Tensor, parts: Sequence[torch.Tensor], close: Close) -> "Layout | None":
        """``layout`` at the simple factor that brings the ranks' value closest to ``ref``, if it is close then."""
        a = layout.assemble(parts)
        for c in _tried(fit_scale(a, ref), layout.world):
            if (self.scaled or c == 1) and close(a * float(c), ref):
                return dataclasses.replace(layout, factor=c)
        return None

    def factors(self, layout: "Layout", phase: str | None) -> tuple[Fraction, ...]:
        """The factors a correct run holds a value of this kind at outside the backward (phase 'forward',
        'optimizer', or None for a step's input): 1."""
        return (Fraction(1),)

    def declared_by(self, layout: "Layout", placement: str, dim: int | None) -> bool:
        """Whether DTensor's placement (on a one-dimensional mesh of the ranks) is this layout."""
        return placement == self.placement


KINDS: dict[LayoutKind, Kind] = {}  # in the order ``candidates`` tries them: the plainest first


def _kind(cls: type[Kind]) -> type[Kind]:
    KINDS[cls.kind] = cls()
    return cls


@_kind
class _Replicated(Kind):
    """Every rank holds the whole value (parameters under DDP, gradients after their all-reduce)."""

    kind = LayoutKind.REPLICATED
    placement = "replicate"

    def assemble(self, layout: "Layout", xs: list[torch.Tensor]) -> torch.Tensor:
        return xs[0]

    def describe(self, layout: "Layout", scale: str) -> str:
        return f"replicated on {layout.world} ranks{scale}"

    def candidates(self, ref_shape, shapes, exchanges) -> list["Layout"]:
        return [Layout(self.kind, len(shapes))] if all(s == ref_shape for s in shapes) else []

    def group_candidates(self, shapes: list[tuple[int, ...]]) -> list["Layout"]:
        return [Layout(self.kind, len(shapes))] if all(s == shapes[0] for s in shapes) else []

    def group_holds(self, members: Sequence[torch.Tensor], close: Close) -> bool:
        first = members[0].detach().to(torch.float64)  # a replicated part only where the group's tensors agree
        return all(close(p.detach().to(torch.float64), first) for p in members[1:])

    def fit(self, layout: "Layout", ref: torch.Tensor, parts: Sequence[torch.Tensor], close: Close) -> "Layout | None":
        # every rank must hold it at the same factor, not rank 0 alone
        x = [p.detach().to(torch.float64) for p in parts]
        for c in _tried(fit_scale(x[0], ref), layout.world):
            if all(close(v * float(c), ref) for v in x):
                return dataclasses.replace(layout, factor=c)
        return None


@_kind
class _Sharded(Kind):
    """Each rank holds a slice along one dimension, in rank order, even or uneven; or, a sharded dim flattened with
    an outer one, equal slices each made of several interleaved blocks."""

    kind = LayoutKind.SHARDED
    placement = "shard"

    def assemble(self, layout: "Layout", xs: list[torch.Tensor]) -> torch.Tensor:
        if layout.order is not None:
            return _in_order(torch.cat(xs, dim=layout.dim), layout.dim, layout.order)
        if layout.blocks == 1:
            return torch.cat(xs, dim=layout.dim)
        d = layout.dim
        split = [x.unflatten(d, (layout.blocks, x.shape[d] // layout.blocks)) for x in xs]
        return torch.cat(split, dim=d + 1).flatten(d, d + 1)

    def describe(self, layout: "Layout", scale: str) -> str:
        even = layout.sizes is not None and len(set(layout.sizes)) == 1
        split = "" if layout.sizes is None else f" ({'+'.join(map(str, layout.sizes))}{'' if even else ', uneven'})"
        turns = "" if layout.blocks == 1 else f" in {layout.blocks} interleaved blocks (a sharded dim flattened)"
        if layout.order is not None:
            turns = " (the batch's rows in another order)"
        return f"sharded on dim {layout.dim} over {layout.world} ranks{split}{turns}{scale}"

    def name(self, layout: "Layout") -> str:
        return f"sharded on dim {layout.dim}" + ("" if layout.order is None else ", rows in another order")

    def candidates(self, ref_shape, shapes, exchanges) -> list["Layout"]:
        world = len(shapes)
        if world < 2 or not all(len(s) == len(ref_shape) for s in shapes):
            return []
        out = []
        for d in range(len(ref_shape)):
            others_equal = all(s[:d] + s[d + 1:] == ref_shape[:d] + ref_shape[d + 1:] for s in shapes)
            sizes = tuple(s[d] for s in shapes)
            if others_equal and sum(sizes) == ref_shape[d] and not all(x == ref_shape[d] for x in sizes):
                out.append(Layout(self.kind, world, d, sizes))
        # (shapes that shard a dim are never the reference's own: these and the reductions never both fit)
        for d in range(len(ref_shape)):
            k = shapes[0][d]
            if any(s[:d] + s[d + 1:] != ref_shape[:d] + ref_shape[d + 1:] or s[d] != k for s in shapes) or \
                    k * world != ref_shape[d]:
                continue
            out += [Layout(self.kind, world, d, tuple(s[d] for s in shapes), blocks=b)
                    for b in range(2, min(k, 64) + 1) if k % b == 0]
        return out

    def declared_by(self, layout: "Layout", placement: str, dim: int | None) -> bool:
        return placement == self.placement and layout.dim == dim and layout.blocks == 1 and layout.order is None

    def group_candidates(self, shapes: list[tuple[int, ...]]) -> list["Layout"]:
        if not all(len(s) == len(shapes[0]) for s in shapes):
            return []
        return [Layout(self.kind, len(shapes), d, tuple(s[d] for s in shapes)) for d in range(len(shapes[0]))
                if all(s[:d] + s[d + 1:] == shapes[0][:d] + shapes[0][d + 1:] for s in shapes)]


class Reduction(Kind):
    """A layout in which every rank holds a value of the reference's shape and the reference is their elementwise
    combination (a sum, a max, a norm): how the ranks' values combine (``combine``)."""

    scaled = False

    def combine(self, stacked: torch.Tensor) -> torch.Tensor:  # stacked: [world, *shape], float64
        raise NotImplementedError

    def assemble(self, layout: "Layout", xs: list[torch.Tensor]) -> torch.Tensor:
        return self.combine(torch.stack(xs))

    def candidates(self, ref_shape, shapes, exchanges) -> list["Layout"]:
        return [Layout(self.kind, len(shapes))] if len(shapes) > 1 and all(s == ref_shape for s in shapes) else []

    def family(self, layout: "Layout", legit: bool) -> str:
        return self.name(layout)


@_kind
class _Sum(Reduction):
    """Partial: the sum over the ranks is the value (local gradients before their all-reduce)."""

    kind = LayoutKind.PARTIAL
    scaled = True
    placement = "partial"

    def combine(self, stacked: torch.Tensor) -> torch.Tensor:
        return stacked.sum(0)

    def describe(self, layout: "Layout", scale: str) -> str:
        if layout.factor == 1:
            return f"partial over {layout.world} ranks: the reference is their sum"
        if layout.factor == Fraction(1, layout.world):
            return f"partial over {layout.world} ranks: the reference is their average (a per-rank mean)"
        return f"partial over {layout.world} ranks: their sum is {ratio_text(1 / layout.factor)}x the reference"

    def family(self, layout: "Layout", legit: bool) -> str:
        if layout.factor == 1:
            return "partial (a sum)"
        if layout.factor == Fraction(1, layout.world):
            return "partial (a per-micro-batch mean)" if layout.passes > 1 else "partial (a per-rank mean)"
        return f"partial at {ratio_text(1 / layout.factor)}x"

    def group_candidates(self, shapes: list[tuple[int, ...]]) -> list["Layout"]:
        return [Layout(self.kind, len(shapes))] if all(s == shapes[0] for s in shapes) else []

    def factors(self, layout: "Layout", phase: str | None) -> tuple[Fraction, ...]:
        if phase == "optimizer":
            # what the optimizer makes (the parameters, its state) is kept: whole on a rank, or a shard of it (over
            # a mesh's groups, the groups' parts)
            return () if layout.inner is None else (Fraction(1),)
        # a per-rank mean's part; with accumulation on the ranks, a pass's mean divided by the number of passes
        return (Fraction(1), Fraction(1, layout.world)) + \
            ((Fraction(layout.passes, layout.world),) if layout.passes > 1 else ())


@_kind
class _Max(Reduction):
    """The largest over the ranks is the value (a per-rank max the program reduces with a max)."""

    kind = LayoutKind.MAX
    picks = True

    def combine(self, stacked: torch.Tensor) -> torch.Tensor:
        return stacked.amax(0)

    def describe(self, layout: "Layout", scale: str) -> str:
        return f"the max over {layout.world} ranks is the reference{scale}"

    def name(self, layout: "Layout") -> str:
        return "max over ranks"


@_kind
class _Min(Reduction):
    kind = LayoutKind.MIN
    picks = True

    def combine(self, stacked: torch.Tensor) -> torch.Tensor:
        return stacked.amin(0)

    def describe(self, layout: "Layout", scale: str) -> str:
        return f"the min over {layout.world} ranks is the reference{scale}"

    def name(self, layout: "Layout") -> str:
        return "min over ranks"


@_kind
class _Norm(Reduction):
    """The 2-norm over the ranks' values is the value (each rank's norm of its shard: DTensor's _NormP)."""

    kind = LayoutKind.NORM
    placement = "norm"
    scaled = True  # a norm of gradients divided twice is the norm at 1/2x: said so, not as a sum at some ratio

    def combine(self, stacked: torch.Tensor) -> torch.Tensor:
        return stacked.pow(2).sum(0).sqrt()

    def describe(self, layout: "Layout", scale: str) -> str:
        held = "the reference" if layout.factor == 1 else f"{ratio_text(1 / layout.factor)}x the reference"
        return f"the 2-norm over {layout.world} ranks' norms (each rank's norm of its shard) is {held}"

    def name(self, layout: "Layout") -> str:
        return "norm over ranks (each rank's norm of its shard)"

    def family(self, layout: "Layout", legit: bool) -> str:
        return Kind.family(self, layout, legit)


# Expert parallelism: the two ways its ranks hold a value (diff/parallel/experts.py finds which ops hold which).

@_kind
class _Held(Kind):
    """One rank alone holds the whole value: an expert's op, run on the rank that holds the expert (the other ranks
    run no counterpart). Not found from shapes: the diff knows which ops one rank holds."""

    kind = LayoutKind.HELD

    def assemble(self, layout: "Layout", xs: list[torch.Tensor]) -> torch.Tensor:
        return xs[0]

    def describe(self, layout: "Layout", scale: str) -> str:
        return f"held whole by rank {layout.holder} alone, the rank that holds this expert{scale}"

    def name(self, layout: "Layout") -> str:
        return "held by its expert's rank"


@_kind
class _Routed(Kind):
    """Rows routed to experts: each rank holds its rows grouped by the rank they are sent to (an all-to-all's
    input, with its split sizes), the reference the same rows grouped over every rank: block b of each rank in rank
    order, then block b + 1 (each rank keeps its rows in order within a block, as a stable sort does)."""

    kind = LayoutKind.ROUTED

    def assemble(self, layout: "Layout", xs: list[torch.Tensor]) -> torch.Tensor:
        blocks = [x.split(list(s), dim=layout.dim) for x, s in zip(xs, layout.splits or ())]
        return torch.cat([b[k] for k in range(len(blocks[0])) for b in blocks], dim=layout.dim)

    def describe(self, layout: "Layout", scale: str) -> str:
        rows = ", ".join(f"rank {r}: {'+'.join(map(str, s))}" for r, s in enumerate(layout.splits or ()))
        blocks = len(layout.splits[0]) if layout.splits else 0
        if blocks > layout.world:  # a block per expert, several experts on a rank
            return f"routed on dim {layout.dim} over {layout.world} ranks: each rank's rows grouped by the expert " \
                   f"they are sent to ({blocks} experts, {blocks // layout.world} on each rank; {rows}), the " \
                   f"reference's by the same experts over every rank{scale}"
        return f"routed on dim {layout.dim} over {layout.world} ranks: each rank's rows grouped by the rank they are " \
               f"sent to ({rows}), the reference's by the same ranks over every rank{scale}"

    def name(self, layout: "Layout") -> str:
        return "routed to experts (all-to-all blocks)"

    def candidates(self, ref_shape, shapes, exchanges) -> list["Layout"]:
        world = len(shapes)
        if world < 2 or not ref_shape or not all(len(s) == len(ref_shape) and s[1:] == ref_shape[1:] for s in shapes):
            return []
        return [Layout(self.kind, world, 0, tuple(s[0] for s in shapes), splits=splits)
                for splits in dict.fromkeys(exchanges)
                if len(splits) == world and all(len(x) == len(splits[0]) > 1 for x in splits)
                and all(sum(x) == s[0] for x, s in zip(splits, shapes)) and sum(map(sum, splits)) == ref_shape[0]]


def ratio_text(f: Fraction) -> str:
    """A factor as people write it: '2', '1/4'."""
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


def candidates(ref_shape: Sequence[int], shapes: Sequence[Sequence[int]], exchanges: Sequence[Splits] = ()
               ) -> list[Layout]:
    """The layouts the shapes allow, plainest first (replicated, sharded by dimension, partial, then routed by the
    split sizes of ``exchanges``: the all-to-alls the ranks ran), at factor 1: each registered kind's in turn."""
    ref_shape, shapes = tuple(ref_shape), [tuple(s) for s in shapes]
    if not shapes:
        return []
    return [layout for k in KINDS.values() for layout in k.candidates(ref_shape, shapes, exchanges)]


_MOST_WHOLE = 1 << 20  # the largest whole factor (or its reciprocal) fit_scale names


def _tried(fitted: Fraction | None, world: int) -> list[Fraction]:
    """The factors a layout is tried at: 1, the world size either way, then the one that fits best. A value that
    is rounding alone (a conv's bias gradient before a normalisation, whose terms cancel) has no ratio to the
    reference's worth fitting (any would do within its limit, counted from the sum's terms): it is judged at the
    factors a program applies first. A value its limit holds tight fits at one factor only, whichever is tried."""
    plain = [Fraction(1), Fraction(1, world), Fraction(world)]
    return plain + ([] if fitted is None or fitted in plain else [fitted])


def fit_scale(x: torch.Tensor, ref: torch.Tensor, most: int = 64) -> Fraction | None:
    """The simple ratio c (numerator and denominator at most ``most``) with c * x closest to ``ref``, by least
    squares over the finite values; None when there is none (one side all zeros and the other not, or a ratio that
    is not simple: then no factor explains the difference; a whole number or its reciprocal may pass ``most``). 1
    when both are all zeros."""
    a, b = x.to(torch.float64), ref.detach().to(torch.float64)
    keep = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[keep], b[keep]
    aa = float((a * a).sum())
    bb = float((b * b).sum())
    if aa == 0 or bb == 0:
        return Fraction(1) if aa == bb else None
    c = float((a * b).sum()) / aa
    if not c > 0:
        return None
    snapped = Fraction(c).limit_denominator(most)
    if a.numel() == 1 and snapped.numerator != 1 and snapped.denominator != 1 and \
            max(snapped.numerator, snapped.denominator) > 8:
        # one number is some ratio of any other: only a plain one (a count, one over it, a small fraction) is a
        # factor a program applies; 41/58 is a coincidence, not a layout
        snapped = Fraction(0)
    if snapped == 0 or snapped.numerator > most or abs(float(snapped) - c) > 1e-3 * c:
        # a whole number, or one over it, past ``most``: a sum over a batch's tokens against their mean (the count
        # is in the thousands); the caller's closeness test on the scaled value is what admits it
        whole = Fraction(round(c)) if c >= 1 else Fraction(1, round(1 / c))
        if whole == 0 or max(whole.numerator, whole.denominator) > _MOST_WHOLE or \
                abs(float(whole) - c) > 1e-3 * c:
            return None
        return whole
    return snapped


def infer_layouts(ref: torch.Tensor, parts: Sequence[torch.Tensor], close: Close, exchanges: Sequence[Splits] = ()
                  ) -> list[Layout]:
    """Every layout the shapes allow under which ``parts`` (one tensor per rank, in rank order) stand for ``ref``
    by ``close(mapped, ref)``, plainest first, each with the simple factor it takes (``Layout.factor``: 1 when the
    ranks hold the reference itself). Several can fit: ranks that each hold a quarter of a count are a value
    replicated at 1/4 and a partial one at 1; which factor is right is the caller's to judge."""
    fits = (KINDS[layout.kind].fit(layout, ref, parts, close)
            for layout in candidates(ref.shape, [p.shape for p in parts], exchanges))
    return [f for f in fits if f is not None]


def order_index(order: tuple[int, ...], extent: int) -> torch.Tensor:
    """For a dim of ``extent`` positions whose rows (runs of extent / len(order) positions: the batch flattened with
    the sequence) the ranks hold in ``order`` (``Layout.order``): the reference's position of each joined one."""
    run = extent // len(order)
    at = torch.tensor(order, dtype=torch.long)
    return (at[:, None] * run + torch.arange(run)).flatten() if run > 1 else at


def _in_order(joined: torch.Tensor, dim: int, order: tuple[int, ...]) -> torch.Tensor:
    """``joined`` (the ranks' parts joined along ``dim``, row i being the reference's row ``order[i]``) put back in
    the reference's order."""
    return torch.empty_like(joined).index_copy_(dim, order_index(order, int(joined.shape[dim])), joined)


def reordered_layouts(ref: torch.Tensor, parts: Sequence[torch.Tensor], close: Close,
                      orders: dict[int, tuple[int, ...]]) -> list[Layout]:
    """The sharded layouts of ``parts`` whose joined rows are the reference's in one of ``orders`` (by the number of
    rows: the orders in which the ranks hold the batches of this step), on any dim the shapes shard whose extent is
    a multiple of an order's rows, each at the simple factor it takes; fitted as ``infer_layouts`` does."""
    out = []
    shapes = [tuple(p.shape) for p in parts]
    for layout in KINDS[LayoutKind.SHARDED].candidates(tuple(ref.shape), shapes, ()):
        if layout.blocks != 1:
            continue
        for n, order in orders.items():
            if ref.shape[layout.dim] % n == 0:
                fit = KINDS[LayoutKind.SHARDED].fit(dataclasses.replace(layout, order=order), ref, parts, close)
                if fit is not None:
                    out.append(fit)
    return out


def _inner_candidates(members: Sequence[torch.Tensor]) -> list[Layout]:
    """The layouts one group's tensors can hold a part of a value in, with no reference to size them by, each
    kind's in turn (replicated, sharded on a dimension, partial)."""
    shapes = [tuple(p.shape) for p in members]
    return [layout for k in KINDS.values() for layout in k.group_candidates(shapes)]


def infer_mesh_layouts(ref: torch.Tensor, parts: Sequence[torch.Tensor], close: Close,
                       groupings: Sequence[tuple[tuple[int, ...], ...]]) -> list[Layout]:
    """Layouts over a two-dimensional mesh of ranks: for each way of grouping the ranks (``groupings``: the mesh's
    rows, then its columns), each layout every group holds its part in (the same for every group; a replicated part
    only where the group's tensors agree by ``close``), then every layout the groups' parts hold ``ref`` in, as
    ``infer_layouts`` finds them (the factor on the outer layout). Plainest first within each grouping."""
    out: list[Layout] = []
    for groups in groupings:
        for inner in _inner_candidates([parts[i] for i in groups[0]]):
            held = []
            for g in groups:
                members = [parts[i] for i in g]
                if not any(c.kind is inner.kind and c.dim == inner.dim for c in _inner_candidates(members)):
                    break
                if not KINDS[inner.kind].group_holds(members, close):
                    break
                held.append(dataclasses.replace(inner, sizes=None if inner.sizes is None else
                                                tuple(int(p.shape[inner.dim]) for p in members)).assemble(members))
            else:
                for f in infer_layouts(ref, held, close):
                    out.append(dataclasses.replace(f, inner=inner, groups=tuple(groups)))
    return out


def infer_layout(ref: torch.Tensor, parts: Sequence[torch.Tensor], close: Close, exchanges: Sequence[Splits] = ()
                 ) -> Layout | None:
    """The plainest layout under which ``parts`` stand for ``ref`` (``infer_layouts``'s first), or None when no
    layout the shapes allow fits at any simple factor."""
    fits = infer_layouts(ref, parts, close, exchanges)
    return fits[0] if fits else None


def shard_offsets(ref: torch.Tensor, parts: Sequence[torch.Tensor], close: Close) -> tuple[int, list[int]] | None:
    """For parts that each equal a slice of ``ref`` along one dimension but do not join into it in rank order: the
    dimension and the offset each rank's part was taken at (a shard taken at the wrong offset, ranks swapped).
    None when some part is no slice of the reference along a dimension the shapes allow."""
    for layout in candidates(ref.shape, [p.shape for p in parts]):
        if layout.kind is not LayoutKind.SHARDED or layout.dim is None or layout.blocks != 1:
            continue
        d, n = layout.dim, ref.shape[layout.dim]
        offsets = []
        for p in parts:
            size = p.shape[d]
            step = 1 if n <= 1024 or not size or n % size else size  # any offset where the dim is short
            at = next((o for o in range(0, n - size + 1, step)
                       if close(p.detach().to(torch.float64), ref.narrow(d, o, size))), None)
            if at is None:
                break
            offsets.append(at)
        else:
            return d, offsets
    return None


def rel_l2_close(limit: float) -> Close:
    """A closeness test on the relative L2 error, in float64 (NaN/Inf must sit at the same places with the same
    values): for tests and quick checks; the diff engine passes its per-dtype verdict instead."""

    def close(x: torch.Tensor, ref: torch.Tensor) -> bool:
        a, b = x.to(torch.float64), ref.detach().to(torch.float64)
        if a.shape != b.shape:
            return False
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        if not torch.equal(torch.isnan(a), torch.isnan(b)) or not torch.equal(torch.isinf(a), torch.isinf(b)) \
                or not torch.equal(a[torch.isinf(a)], b[torch.isinf(b)]):
            return False
        a, b = a[fa], b[fb]
        scale = torch.linalg.vector_norm(b)
        err = torch.linalg.vector_norm(a - b)
        return bool(err <= limit * scale) if scale > 0 else bool(err == 0)

    return close
