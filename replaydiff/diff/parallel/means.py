"""A per-rank mean over ranks that hold different counts (of tokens, of rows), found from the op's own count: a loss
op that returns the number it divided by (``nll_loss_forward``'s total weight) shows that the ranks' counts differ
and that the reference's value is the ranks' means weighted by them. Averaging such means as if the counts were
equal is the bug; the words name it with the counts."""
from __future__ import annotations

import math

import torch

from replaydiff.diff.parallel.result import Mapped
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import OpRecord, TensorRef


def _scalar(trace: RankTrace, ref) -> float | None:
    if ref is None or not ref.stored or ref.meta or ref.uninitialised:
        return None
    t = trace.tensor(ref)
    return float(t.to(torch.float64)) if t.numel() == 1 else None


def unequal_counts(ref: RankTrace, ranks: list[RankTrace], rop: OpRecord, tops: list[OpRecord],
                   m: Mapped) -> tuple[tuple[float, ...], str] | None:
    """(each rank's count, where the op holds it: 'output 1', 'input 1') when output ``m`` is a mean over a count
    the op also returns (a loss's total weight) or divides by (a sum divided by a count), the counts differ, they
    sum to the reference's, and the reference's mean is the ranks' means weighted by them; None otherwise."""
    outs = rop.outputs_refs()
    if m.kind != "out" or m.layout is not None or len(ranks) < 2:
        return None
    mean = _scalar(ref, outs[m.position])
    theirs = [_scalar(r, t.outputs_refs()[m.position] if m.position < len(t.outputs_refs()) else None)
              for r, t in zip(ranks, tops)]
    if mean is None or any(v is None for v in theirs):
        return None
    # the op's other outputs, and a division's divisor
    found = [(f"output {k}", cref, [t.outputs_refs()[k] if k < len(t.outputs_refs()) else None for t in tops])
             for k, cref in enumerate(outs) if k != m.position]
    if rop.name == "aten.div.Tensor" and len(rop.args) > 1 and isinstance(rop.args[1], TensorRef):
        found.append(("input 1", rop.args[1], [t.args[1] if len(t.args) > 1 and isinstance(t.args[1], TensorRef)
                                               else None for t in tops]))
    for where, cref, trefs in found:
        total = _scalar(ref, cref)
        counts = [_scalar(r, t) for r, t in zip(ranks, trefs)]
        if total is None or any(c is None for c in counts) or len(set(counts)) < 2 or not sum(counts):
            continue
        if not math.isclose(sum(counts), total, rel_tol=1e-6):
            continue
        weighted = sum(v * c for v, c in zip(theirs, counts)) / sum(counts)
        if math.isclose(weighted, mean, rel_tol=1e-4, abs_tol=1e-12):
            return tuple(counts), where
    return None
