"""One tensor of an aligned op mapped onto the reference's through every layout that fits."""
from __future__ import annotations

import dataclasses
import math

import torch

from replaydiff import aten
from replaydiff.compare.layout import (KINDS, Close, Layout, LayoutKind, candidates, infer_layouts, infer_mesh_layouts,
                                       order_index, rel_l2_close, reordered_layouts,
                                       shard_offsets)
from replaydiff.compare.reordered import Limit, counts_terms, fallback, limit_of
from replaydiff.trace.placements import DTensorArg
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import OpRecord, TensorRef
from replaydiff.diff.parallel.declared import declares
from replaydiff.diff.parallel.result import Mapped, MappedOp
from replaydiff.diff.parallel.rows import row_order


def close_for(dtype: torch.dtype, limit: Limit | None = None) -> Close:
    """Whether a mapped value is the reference's: rel_l2 within ``limit`` (compare/reordered.py: counted from the
    terms of the sums that made it; without one, sqrt(eps) of the recorded dtype, half its digits: a scale, an
    unreduced sum or per-rank statistics fall far outside); integers and booleans exactly."""
    if dtype.is_floating_point:
        eps = torch.finfo(dtype).eps
        return rel_l2_close((limit or fallback(dtype)).eps * eps)

    def exact(x: torch.Tensor, ref: torch.Tensor) -> bool:
        return tuple(x.shape) == tuple(ref.shape) and torch.equal(x.to(torch.float64), ref.to(torch.float64))

    return exact


def limit_for(ref: RankTrace, rop: OpRecord | None, value: torch.Tensor,
              reads: float | None, output: int = 0) -> Limit | None:
    """The limit of one reference value as compare/reordered.py forms it: from the terms of the sum ``rop`` (the op
    that made it, as its output ``output``; None: a value from outside the step) computes it by, where every value it
    reads was measured (``reads``: their largest error, eps; None: some was not); sqrt(eps) otherwise. None: not
    floating (exact)."""
    if not value.is_floating_point():
        return None
    if rop is not None and isinstance(rop.outputs, (list, tuple)) and \
            all(o is None or isinstance(o, TensorRef) for o in rop.outputs):
        # ``output`` counts the tensors the op returned; its schema's outputs count the ones it did not (None) too
        held = [k for k, o in enumerate(rop.outputs) if o is not None]
        output = held[output] if output < len(held) else output
    if rop is None or reads is None or not counts_terms(aten.packet(rop.name), output):
        return fallback(value.dtype, reads)
    if not all(t.stored and not t.meta and not t.uninitialised for t in rop.inputs()):
        return fallback(value.dtype, reads)

    def load(a):
        return ref.tensor(a) if isinstance(a, TensorRef) else a

    args = [load(a) for a in rop.args]
    kwargs = {k: load(v) for k, v in rop.kwargs.items()}
    return limit_of(aten.packet(rop.name), args, kwargs, value, reads, output)


def measured_reads(ins: list[TensorRef], producers: dict[int, int | None], made: dict[int, MappedOp],
                   outside: dict[int, float]) -> float | None:
    """The largest error (rel_l2 / eps) measured on the values an op reads: each from the op that made it (its
    outputs' largest, as mapped), or from outside the step as mapped where first read (``outside``: by storage
    version); None when some value it reads was not measured (not mapped, or read from the ranks' own ops)."""
    worst = 0.0
    for pos, r in enumerate(ins):
        p = producers.get(pos)
        if p is None:
            e = outside.get(r.version)
        else:
            op = made.get(p)
            errs = [] if op is None else [t.error for t in op.tensors if t.kind == "out" and t.error is not None]
            e = max(errs) if errs else None
        if e is None or not math.isfinite(e):
            return None
        worst = max(worst, e)
    return worst


def rel_l2(layout: Layout, parts: list[torch.Tensor], ref: torch.Tensor) -> float:
    """The relative L2 error of the ranks' mapped value against the reference, over positions finite in both."""
    m, b = layout.mapped(parts), ref.to(torch.float64)
    keep = torch.isfinite(m) & torch.isfinite(b)
    den = float(torch.linalg.vector_norm(b[keep]))
    num = float(torch.linalg.vector_norm((m - b)[keep]))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def map_tensor(ref: RankTrace, targets: list[RankTrace], rref: TensorRef, trefs: list[TensorRef], kind: str,
               pos: int, world: int, micro: int | None = None, declared: DTensorArg | None = None,
               mesh: tuple[tuple[tuple[int, ...], ...], ...] | None = None, passes: int = 1,
               rop: OpRecord | None = None, reads: float | None = None,
               orders: dict[int, tuple[int, ...]] | None = None,
               reduced_with: frozenset[str] = frozenset()) -> Mapped | None:
    """How the ranks hold one tensor of an aligned op; None when it cannot be compared (no data, uninitialised).
    ``rop``: the reference op that made it (an output), and ``reads``: the largest error measured on what that op
    reads (``measured_reads``), from which its limit is counted (``limit_for``); without them, sqrt(eps).
    ``micro``: one rank's op against the reference's micro-batch of that number (``targets`` is that rank alone).
    ``passes``: each rank runs the op once per micro-batch of its share, ``targets`` holding each rank ``passes``
    times (rank-major, one entry per pass). ``orders``: the orders in which the ranks hold the step's batches, by
    their number of rows (``Layout.order``), tried where no other layout fits; a tensor from outside the step whose
    rows the ranks hold in another order is given its order. ``reduced_with``: the reduce ops of the ranks'
    collectives ("max", "min"): a max or min over the ranks is a layout only in a job that reduces with it."""
    if not rref.stored or rref.meta or rref.uninitialised or not all(t.stored and not t.meta for t in trefs):
        return None
    r = ref.tensor(rref)
    parts = [targets[k].tensor(t) for k, t in enumerate(trefs)]
    limit = limit_for(ref, rop if kind == "out" else None, r, reads, pos)
    close = close_for(r.dtype, limit)
    # A max or min over the ranks fits any value that one rank alone got wrong in one direction (the min of 1 and
    # 1.01 is 1): a layout only where the job reduces with it (an amax all-reduced with MAX)
    fits = [f for f in infer_layouts(r, parts, close) if not KINDS[f.kind].picks or f.kind.value in reduced_with]
    if not fits and micro is None:
        # (a batch, which needs no gradient, in rows; whole slices in another order are a shard taken at the wrong
        # offset, said as such below)
        if kind == "in" and not rref.requires_grad and shard_offsets(r, parts, close) is None and \
                (order := row_order(r, parts)) is not None:
            fits = [Layout(LayoutKind.SHARDED, len(parts), 0, tuple(int(p.shape[0]) for p in parts), order=order)]
        elif orders:
            fits = reordered_layouts(r, parts, close, orders)
    if mesh is not None and micro is None:
        # a value every rank holds whole, or a slice of, first; then the layouts within the mesh's rows or columns,
        # before a sum over every rank (a per-rank mean over the mesh's data-parallel dimension is partial over its
        # rows, at 1/rows, not over all the ranks: the backward's factor follows from it)
        flat = [f for f in fits if f.kind in (LayoutKind.REPLICATED, LayoutKind.SHARDED)]
        fits = flat + infer_mesh_layouts(r, parts, close, mesh) + [f for f in fits if f not in flat]
    if micro is not None:
        fits = [dataclasses.replace(f, world=world, micro_batch=micro, passes=passes) for f in fits]
    elif passes > 1:
        fits = [dataclasses.replace(f, passes=passes) for f in fits]
    elif declared is not None:  # what DTensor declared first, when it fits; the plainest otherwise
        fits = sorted(fits, key=lambda f: not declares(declared, f))
    layout = fits[0] if fits else None
    eps = torch.finfo(r.dtype).eps if r.dtype.is_floating_point else 1.0
    error = None if layout is None else rel_l2(layout, parts, r) / eps
    off: tuple[int, ...] = ()
    offsets = None
    if layout is None:
        if all(tuple(p.shape) == tuple(r.shape) for p in parts):
            off = _whole_off(r, parts, close, world if micro is None else 1)
        else:
            off = _slices_off(r, parts, close, world if micro is None else 1, orders)
        found = None if micro is not None else shard_offsets(r, parts, close)
        offsets = None if found is None else (found[0], tuple(found[1]))
    sizes = None if offsets is None else tuple(int(p.shape[offsets[0]]) for p in parts)
    # every rank holds the same piece, smaller than the reference (each read the same shard of the batch)
    alike = layout is None and len(parts) > 1 and tuple(parts[0].shape) != tuple(r.shape) and \
        parts[0].numel() > 0 and all(tuple(p.shape) == tuple(parts[0].shape) and torch.equal(p, parts[0])
                                     for p in parts[1:])
    return Mapped(kind, pos, rref.describe(), layout, error, off, offsets, tuple(fits), sizes,
                  None if micro is not None else declared, alike, None if limit is None else limit.eps, limit)


def reordered_input(ref: RankTrace, targets: list[RankTrace], rref: TensorRef, trefs: list[TensorRef],
                    pos: int, passes: int) -> Mapped | None:
    """A tensor from outside the reference's step that each rank (or each rank's pass) reads through a view of its
    own (its micro-batch's slice of its share): mapped as ``map_tensor`` maps an input, when the pieces joined are
    the reference's rows in another order (``row_order``); None otherwise (those views are judged where an op that
    computes reads them)."""
    if not rref.stored or rref.meta or rref.uninitialised or rref.requires_grad or \
            not all(t.stored and not t.meta for t in trefs):
        return None
    parts = [targets[k].tensor(t) for k, t in enumerate(trefs)]
    order = row_order(ref.tensor(rref), parts)
    if order is None:
        return None
    layout = Layout(LayoutKind.SHARDED, len(parts), 0, tuple(int(p.shape[0]) for p in parts), order=order,
                    passes=passes)
    return Mapped("in", pos, rref.describe(), layout, 0.0, fits=(layout,))


def _slices_off(r: torch.Tensor, parts: list[torch.Tensor], close, world: int,
                orders: dict[int, tuple[int, ...]] | None = None) -> tuple[int, ...]:
    """For parts shaped as the reference's slices along one dimension, in order or in one of ``orders`` (the rows of
    the step's batches as the ranks hold them), at factor 1, or the world size or the number of parts either way (a
    per-rank or per-micro-batch mean's gradient): the parts whose slice is not the reference's, where some part's
    is (one rank's values off: its own scale or input); empty otherwise."""
    n = len(parts)
    layouts = [c for c in candidates(r.shape, [p.shape for p in parts])
               if c.kind is LayoutKind.SHARDED and c.dim is not None and c.blocks == 1]
    for c in list(layouts):
        layouts += [dataclasses.replace(c, order=o) for k, o in (orders or {}).items() if r.shape[c.dim] % k == 0]
    best: tuple[int, ...] = ()
    for layout in layouts:
        d = layout.dim
        ref = r if layout.order is None else r.index_select(d, order_index(layout.order, int(r.shape[d])))
        for factor in _factors(world, n):
            at, bad = 0, []
            for k, p in enumerate(parts):
                size = int(p.shape[d])
                if not close(p.to(torch.float64), factor * ref.narrow(d, at, size)):
                    bad.append(k)
                at += size
            if len(bad) < len(parts) and (not best or len(bad) < len(best)):
                best = tuple(bad)  # the reading that leaves the fewest parts off
    return best


def _factors(world: int, n: int) -> tuple[float, ...]:
    """The factors a part may hold its share at: 1, the world size or the number of parts (a rank's micro-batches)
    either way (a per-rank or per-micro-batch mean's gradient)."""
    return tuple(dict.fromkeys((1.0, float(world), 1.0 / world, float(n), 1.0 / n)))


def _whole_off(r: torch.Tensor, parts: list[torch.Tensor], close, world: int) -> tuple[int, ...]:
    """For parts shaped as the reference: the parts that do not hold it, at the factor that leaves the fewest off
    (where some part holds it); every part when none does."""
    best = tuple(range(len(parts)))
    ref = r.to(torch.float64)
    for factor in _factors(world, len(parts)):
        bad = tuple(k for k, p in enumerate(parts) if not close(p.to(torch.float64), factor * ref))
        if len(bad) < len(best):
            best = bad
    return best
