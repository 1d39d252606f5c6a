"""One tensor of an aligned op mapped onto the reference's through every layout that fits."""
from __future__ import annotations

import dataclasses
import math

import torch

from replaydiff.compare.layout import (Close, Layout, LayoutKind, infer_layouts, infer_mesh_layouts, rel_l2_close,
                                       shard_offsets)
from replaydiff.trace.placements import DTensorArg
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import TensorRef
from replaydiff.diff.parallel.declared import declares
from replaydiff.diff.parallel.result import Mapped


def close_for(dtype: torch.dtype) -> Close:
    """Whether a mapped value is the reference's: rel_l2 within sqrt(eps) of the recorded dtype (half its digits:
    a reordered sum, a gradient reduced in another order and what they feed stay orders of magnitude inside; a
    scale, an unreduced sum or per-rank statistics fall far outside); integers and booleans exactly."""
    if dtype.is_floating_point:
        return rel_l2_close(math.sqrt(torch.finfo(dtype).eps))

    def exact(x: torch.Tensor, ref: torch.Tensor) -> bool:
        return tuple(x.shape) == tuple(ref.shape) and torch.equal(x.to(torch.float64), ref.to(torch.float64))

    return exact


def rel_l2(layout: Layout, parts: list[torch.Tensor], ref: torch.Tensor) -> float:
    """The relative L2 error of the ranks' mapped value against the reference, over positions finite in both."""
    m, b = layout.mapped(parts), ref.to(torch.float64)
    keep = torch.isfinite(m) & torch.isfinite(b)
    den = float(torch.linalg.vector_norm(b[keep]))
    num = float(torch.linalg.vector_norm((m - b)[keep]))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def map_tensor(ref: RankTrace, targets: list[RankTrace], rref: TensorRef, trefs: list[TensorRef], kind: str,
               pos: int, world: int, micro: int | None = None, declared: DTensorArg | None = None,
               mesh: tuple[tuple[tuple[int, ...], ...], ...] | None = None, passes: int = 1) -> Mapped | None:
    """How the ranks hold one tensor of an aligned op; None when it cannot be compared (no data, uninitialised).
    ``micro``: one rank's op against the reference's micro-batch of that number (``targets`` is that rank alone).
    ``passes``: each rank runs the op once per micro-batch of its share, ``targets`` holding each rank ``passes``
    times (rank-major, one entry per pass)."""
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
        close = close_for(r.dtype)
        if all(tuple(p.shape) == tuple(r.shape) for p in parts):
            off = tuple(k for k, p in enumerate(parts) if not close(p.to(torch.float64), r))
        found = None if micro is not None else shard_offsets(r, parts, close)
        offsets = None if found is None else (found[0], tuple(found[1]))
    sizes = None if offsets is None else tuple(int(p.shape[offsets[0]]) for p in parts)
    # every rank holds the same piece, smaller than the reference (each read the same shard of the batch)
    alike = layout is None and len(parts) > 1 and tuple(parts[0].shape) != tuple(r.shape) and \
        parts[0].numel() > 0 and all(tuple(p.shape) == tuple(parts[0].shape) and torch.equal(p, parts[0])
                                     for p in parts[1:])
    return Mapped(kind, pos, rref.describe(), layout, error, off, offsets, tuple(fits), sizes,
                  None if micro is not None else declared, alike,
                  1 / math.sqrt(eps) if r.dtype.is_floating_point else None)
