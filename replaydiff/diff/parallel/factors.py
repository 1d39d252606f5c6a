"""The factors a correct parallel run holds a value at (1; a per-rank mean's 1/world; the backward's loss factor)."""
from __future__ import annotations

import dataclasses
from fractions import Fraction

from replaydiff.compare.layout import KINDS, Layout
from replaydiff.diff.parallel.result import Mapped


def legit_factors(layout: Layout, phase: str | None, loss: Fraction | None) -> tuple[Fraction, ...]:
    """The factors a correct parallel run has: 1; 1/world for a per-rank mean in the forward (a partial value: the
    loss of a rank's slice of the batch); and in the backward the factor of the loss it differentiates (``loss``:
    each rank's gradients are of its own loss, 1/world of the reference's in sum when that is a per-rank mean), until
    the gradients' all-reduce divides by the world size. None for a sum over the ranks that the optimizer makes."""
    if layout.micro_batch is not None:
        # rank r's own value against micro-batch r's: the same, but for the gradients of a reference that divides
        # each micro-batch's loss by the number of micro-batches (the world size), as gradient accumulation does
        # (k micro-batches to a rank on both sides: each process divides its losses by its own count, the ranks' world
        # times smaller, so the loss and what follows from it are at 1/world in the forward too; a forward value
        # scaled so by a bug still parts at the sinks)
        return (Fraction(1), Fraction(1, layout.world)) if phase == "backward" or layout.passes > 1 else \
            (Fraction(1),)
    if phase == "backward":
        return (Fraction(1),) if loss is None or loss == 1 else (Fraction(1), loss)
    return KINDS[layout.kind].factors(layout, phase)


def pick_legit(m: Mapped, phase: str | None, loss: Fraction | None) -> Mapped:
    """Of the layouts that fit, the first at a factor a correct run has there (a count each rank holds a quarter of
    is partial, not replicated at 1/4), else the plainest."""
    good = next((f for f in m.fits if f.factor in legit_factors(f, phase, loss)), None)
    if good is None or good is m.layout:
        return m
    return dataclasses.replace(m, layout=good)
