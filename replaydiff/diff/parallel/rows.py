"""Rows of a dataset picked one at a time (a DataLoader over a map-style dataset: ``dataset[i]`` is ``select``), in
another order on the ranks than in the single process: a ``DistributedSampler`` interleaves its shards (rank r takes
rows r, r+W, r+2W, ...), so the ranks' rows joined in rank order are the single process's batch permuted, not cut.

Whether the runs picked the same rows is read from the picks' arguments (the dimension and the row number) over the
whole dataset tensor, which every rank and the single process hold alike: the same rows in another order are the
same global batch, which a mean over it cannot tell apart, and no departure; other rows are a different batch.
A batch dealt out before the step (a tensor from outside it) is read the same way, from its rows' values
(``rows_permuted``)."""
from __future__ import annotations

from collections import Counter

import torch

from replaydiff.aten import ROW_PICKS as PICKS
from replaydiff.trace.schema import OpRecord, TensorRef


def _picks(ops: dict[int, OpRecord], source: TensorRef) -> Counter:
    """(dim, row) of each pick of one row of ``source`` (by geometry: the same tensor) among ``ops``."""
    found: Counter = Counter()
    for op in ops.values():
        if op.name not in PICKS or not op.args or not isinstance(op.args[0], TensorRef) or \
                op.args[0].geometry != source.geometry or len(op.args) < 3:
            continue
        dim, row = op.args[1], op.args[2]
        if isinstance(dim, int) and isinstance(row, int):
            n = int(source.shape[dim]) if -len(source.shape) <= dim < len(source.shape) else None
            found[(dim % len(source.shape), row % n if n else row)] += 1
    return found


def rows_picked(rop: OpRecord, r_ops: dict[int, OpRecord], tops: list[OpRecord],
                t_ops: list[dict[int, OpRecord]]) -> tuple[Counter, list[Counter]] | None:
    """(the single process's picks, each rank's) of the rows of the tensor ``rop`` picks one row of (``tops``: its
    op on each rank); None when ``rop`` is no such pick or a rank's tensor is not shaped as the reference's."""
    if rop.name not in PICKS or not rop.args or not isinstance(rop.args[0], TensorRef):
        return None
    source = rop.args[0]
    ranks = []
    for top, ops in zip(tops, t_ops):
        if not top.args or not isinstance(top.args[0], TensorRef) or \
                tuple(top.args[0].shape) != tuple(source.shape):
            return None
        ranks.append(_picks(ops, top.args[0]))
    return _picks(r_ops, source), ranks


def same_rows_reordered(picked: tuple[Counter, list[Counter]] | None) -> bool:
    """Whether the ranks' picks take the single process's rows between them, each as often, in another order."""
    if picked is None:
        return False
    mine, ranks = picked
    return bool(mine) and mine == sum(ranks, Counter())


def same_rows_on_every_rank(picked: tuple[Counter, list[Counter]] | None) -> list[int] | None:
    """The rows every rank picks alike (each rank reading the same shard), in order; None when the ranks' picks
    differ or the single process picks those rows alone."""
    if picked is None:
        return None
    mine, ranks = picked
    if len(ranks) < 2 or not ranks[0] or any(r != ranks[0] for r in ranks[1:]) or mine == ranks[0]:
        return None
    return sorted(row for _, row in ranks[0])



def _row_keys(t: torch.Tensor) -> list[bytes]:
    """Each row (along dim 0) of ``t`` as its bytes: rows that are the same values are the same key."""
    flat = t.detach().contiguous().reshape(int(t.shape[0]), -1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
    return [bytes(row.numpy().tobytes()) for row in raw]


def row_order(ref: torch.Tensor, parts: list[torch.Tensor]) -> tuple[int, ...] | None:
    """Where ``parts`` (each rank's, or each (rank, pass)'s, piece of a tensor from outside the step), joined on
    dim 0, are the reference's rows in another order, each exactly as often: for each joined row, the reference's
    row it is (rows alike matched in turn); None otherwise, or when they are in the reference's order. A batch a
    ``DistributedSampler`` dealt out before the step (rank r takes rows r, r+W, ...) is the same global batch, which
    a sum or mean over it cannot tell apart. Exact: the runs read the same data, so the same row has the same bits."""
    if not parts or ref.dim() == 0 or any(p.dim() != ref.dim() or p.dtype != ref.dtype or
                                          tuple(p.shape[1:]) != tuple(ref.shape[1:]) for p in parts):
        return None
    if sum(int(p.shape[0]) for p in parts) != int(ref.shape[0]) or int(ref.shape[0]) < 2:
        return None
    where: dict[bytes, list[int]] = {}
    for i, key in enumerate(_row_keys(ref)):
        where.setdefault(key, []).append(i)
    if len(where) < 2:
        return None  # every row alike: no order to read
    order: list[int] = []
    for p in parts:
        for key in _row_keys(p) if p.shape[0] else ():
            rows = where.get(key)
            if not rows:
                return None
            order.append(rows.pop(0))
    return None if order == sorted(order) else tuple(order)
