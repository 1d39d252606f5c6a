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
    # expert parallelism: each rank holds its rows grouped by the rank they are sent to (an all-to-all's input), the
    # reference the same rows grouped over every rank: block b of every rank in rank order, then block b + 1
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
    # routed: each rank's blocks along ``dim`` (the rows it sends to each rank, in rank order)
    splits: tuple[tuple[int, ...], ...] | None = None

    def assemble(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The value the ranks' tensors stand for (before the factor), in float64: rank 0's for a replicated
        value, the slices joined in rank order for a sharded one, the sum for a partial one."""
        if self.inner is not None and self.groups is not None:
            held = [self.inner.assemble([parts[i] for i in g]) for g in self.groups]
            return dataclasses.replace(self, inner=None, groups=None).assemble(held)
        xs = [p.detach().to(torch.float64) for p in parts]
        if self.kind in (LayoutKind.REPLICATED, LayoutKind.HELD):
            return xs[0]
        if self.kind is LayoutKind.ROUTED and self.splits is not None:
            blocks = [x.split(list(s), dim=self.dim) for x, s in zip(xs, self.splits)]
            return torch.cat([b[k] for k in range(len(self.splits[0])) for b in blocks], dim=self.dim)
        if self.kind is LayoutKind.SHARDED:
            if self.blocks == 1:
                return torch.cat(xs, dim=self.dim)
            d = self.dim
            split = [x.unflatten(d, (self.blocks, x.shape[d] // self.blocks)) for x in xs]
            return torch.cat(split, dim=d + 1).flatten(d, d + 1)
        return REDUCTIONS[self.kind].combine(torch.stack(xs))

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
        if self.kind is LayoutKind.REPLICATED:
            return f"replicated on {self.world} ranks{scale}"
        if self.kind is LayoutKind.HELD:
            return f"held whole by rank {self.holder} alone, the rank that holds this expert{scale}"
        if self.kind is LayoutKind.ROUTED and self.splits is not None:
            rows = ", ".join(f"rank {r}: {'+'.join(map(str, s))}" for r, s in enumerate(self.splits))
            return f"routed on dim {self.dim} over {self.world} ranks: each rank's rows grouped by the rank they are " \
                   f"sent to ({rows}), the reference's by the same ranks over every rank{scale}"
        if self.kind is LayoutKind.SHARDED:
            even = self.sizes is not None and len(set(self.sizes)) == 1
            split = "" if self.sizes is None else f" ({'+'.join(map(str, self.sizes))}{'' if even else ', uneven'})"
            turns = "" if self.blocks == 1 else f" in {self.blocks} interleaved blocks (a sharded dim flattened)"
            return f"sharded on dim {self.dim} over {self.world} ranks{split}{turns}{scale}"
        return REDUCTIONS[self.kind].describe(self, scale)

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
        if self.inner is not None and self.groups is not None:
            out["inner"] = self.inner.to_json()
            out["groups"] = [list(g) for g in self.groups]
        return out


class Reduction:
    """A layout in which every rank holds a value of the reference's shape and the reference is their elementwise
    combination (a sum, a max, a norm): how the ranks' values combine, whether a factor may scale the result, and
    the words for it. One registered subclass per kind (``REDUCTIONS``): a new reduction a parallel run makes is one
    class here."""

    kind: LayoutKind
    scaled = False  # whether the combination may stand for the reference at a factor other than 1 (a sum of means)

    def combine(self, stacked: torch.Tensor) -> torch.Tensor:  # stacked: [world, *shape], float64
        raise NotImplementedError

    def describe(self, layout: "Layout", scale: str) -> str:
        raise NotImplementedError


REDUCTIONS: dict[LayoutKind, Reduction] = {}  # in the order ``candidates`` tries them: the sum first


def _reduction(cls: type[Reduction]) -> type[Reduction]:
    REDUCTIONS[cls.kind] = cls()
    return cls


@_reduction
class _Sum(Reduction):
    """Partial: the sum over the ranks is the value (local gradients before their all-reduce)."""

    kind = LayoutKind.PARTIAL
    scaled = True

    def combine(self, stacked: torch.Tensor) -> torch.Tensor:
        return stacked.sum(0)

    def describe(self, layout: "Layout", scale: str) -> str:
        if layout.factor == 1:
            return f"partial over {layout.world} ranks: the reference is their sum"
        if layout.factor == Fraction(1, layout.world):
            return f"partial over {layout.world} ranks: the reference is their average (a per-rank mean)"
        return f"partial over {layout.world} ranks: their sum is {ratio_text(1 / layout.factor)}x the reference"


@_reduction
class _Max(Reduction):
    """The largest over the ranks is the value (a per-rank max the program reduces with a max)."""

    kind = LayoutKind.MAX

    def combine(self, stacked: torch.Tensor) -> torch.Tensor:
        return stacked.amax(0)

    def describe(self, layout: "Layout", scale: str) -> str:
        return f"the max over {layout.world} ranks is the reference{scale}"


@_reduction
class _Min(Reduction):
    kind = LayoutKind.MIN

    def combine(self, stacked: torch.Tensor) -> torch.Tensor:
        return stacked.amin(0)

    def describe(self, layout: "Layout", scale: str) -> str:
        return f"the min over {layout.world} ranks is the reference{scale}"


@_reduction
class _Norm(Reduction):
    """The 2-norm over the ranks' values is the value (each rank's norm of its shard: DTensor's _NormP)."""

    kind = LayoutKind.NORM

    def combine(self, stacked: torch.Tensor) -> torch.Tensor:
        return stacked.pow(2).sum(0).sqrt()

    def describe(self, layout: "Layout", scale: str) -> str:
        return f"the 2-norm over {layout.world} ranks' norms is the reference (each rank's norm of its shard){scale}"


def ratio_text(f: Fraction) -> str:
    """A factor as people write it: '2', '1/4'."""
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


Splits = tuple[tuple[int, ...], ...]  # each rank's split sizes along dim 0 (an all-to-all's), in rank order


def candidates(ref_shape: Sequence[int], shapes: Sequence[Sequence[int]], exchanges: Sequence[Splits] = ()
               ) -> list[Layout]:
    """The layouts the shapes allow, plainest first (replicated, sharded by dimension, partial, then routed by the
    split sizes of ``exchanges``: the all-to-alls the ranks ran), at factor 1."""
    world = len(shapes)
    ref_shape, shapes = tuple(ref_shape), [tuple(s) for s in shapes]
    if world == 0:
        return []
    same = all(s == ref_shape for s in shapes)
    kinds: list[Layout] = [Layout(LayoutKind.REPLICATED, world)] if same else []
    if world > 1 and all(len(s) == len(ref_shape) for s in shapes):
        for d in range(len(ref_shape)):
            others_equal = all(s[:d] + s[d + 1:] == ref_shape[:d] + ref_shape[d + 1:] for s in shapes)
            sizes = tuple(s[d] for s in shapes)
            if others_equal and sum(sizes) == ref_shape[d] and not all(x == ref_shape[d] for x in sizes):
                kinds.append(Layout(LayoutKind.SHARDED, world, d, sizes))
    if same and world > 1:
        kinds += [Layout(kind, world) for kind in REDUCTIONS]  # the sum first
    # a sharded dim flattened with an outer one: equal slices, each made of several interleaved blocks
    if world > 1 and all(len(s) == len(ref_shape) for s in shapes):
        for d in range(len(ref_shape)):
            k = shapes[0][d]
            if any(s[:d] + s[d + 1:] != ref_shape[:d] + ref_shape[d + 1:] or s[d] != k for s in shapes) or \
                    k * world != ref_shape[d]:
                continue
            kinds += [Layout(LayoutKind.SHARDED, world, d, tuple(s[d] for s in shapes), blocks=b)
                      for b in range(2, min(k, 64) + 1) if k % b == 0]
    # rows routed to experts: each rank's rows in the blocks it sends, the reference's block by block over the ranks
    if world > 1 and ref_shape and all(len(s) == len(ref_shape) and s[1:] == ref_shape[1:] for s in shapes):
        for splits in dict.fromkeys(exchanges):
            if len(splits) == world and all(len(x) == len(splits[0]) > 1 for x in splits) and \
                    all(sum(x) == s[0] for x, s in zip(splits, shapes)) and sum(map(sum, splits)) == ref_shape[0]:
                kinds.append(Layout(LayoutKind.ROUTED, world, 0, tuple(s[0] for s in shapes), splits=splits))
    return kinds


_MOST_WHOLE = 1 << 20  # the largest whole factor (or its reciprocal) fit_scale names


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
    out = []
    for layout in candidates(ref.shape, [p.shape for p in parts], exchanges):
        if layout.kind is LayoutKind.REPLICATED:
            # every rank must hold it at the same factor, not rank 0 alone
            x = [p.detach().to(torch.float64) for p in parts]
            c = fit_scale(x[0], ref)
            if c is not None and all(close(v * float(c), ref) for v in x):
                out.append(dataclasses.replace(layout, factor=c))
            continue
        a = layout.assemble(parts)
        c = fit_scale(a, ref)
        if layout.kind in REDUCTIONS and not REDUCTIONS[layout.kind].scaled and c != 1:
            continue  # a max (or a norm) of scaled values is no reduction a program makes
        if c is not None and close(a * float(c), ref):
            out.append(dataclasses.replace(layout, factor=c))
    return out


def _inner_candidates(members: Sequence[torch.Tensor]) -> list[Layout]:
    """The layouts one group's tensors can hold a part of a value in, with no reference to size them by:
    replicated, sharded on a dimension, partial."""
    n, shapes = len(members), [tuple(p.shape) for p in members]
    out: list[Layout] = []
    same = all(s == shapes[0] for s in shapes)
    if same:
        out.append(Layout(LayoutKind.REPLICATED, n))
    if all(len(s) == len(shapes[0]) for s in shapes):
        for d in range(len(shapes[0])):
            if all(s[:d] + s[d + 1:] == shapes[0][:d] + shapes[0][d + 1:] for s in shapes):
                out.append(Layout(LayoutKind.SHARDED, n, d, tuple(s[d] for s in shapes)))
    if same:
        out.append(Layout(LayoutKind.PARTIAL, n))
    return out


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
                if inner.kind is LayoutKind.REPLICATED:
                    first = members[0].detach().to(torch.float64)
                    if not all(close(p.detach().to(torch.float64), first) for p in members[1:]):
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
