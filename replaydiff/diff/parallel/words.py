"""The words a parallel diff says: a layout's family name, and why a value parts from the reference."""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

from replaydiff import aten
from replaydiff.compare.layout import KINDS, Layout, ratio_text
from replaydiff.trace.schema import OpRecord
from replaydiff.diff.parallel.result import Departure, Mapped


def family(layout: Layout, legit: bool) -> str:
    """The summary line's name of a layout: its kind, and a factor a correct run has named for what it is."""
    if layout.inner is not None:  # a 2-D mesh: the groups' layout, then how each group holds its part
        outer = family(dataclasses.replace(layout, inner=None, groups=None), legit)
        inner = family(layout.inner, True)
        return f"{outer} (each mesh {'row' if layout.groups and layout.groups[0] == tuple(range(len(layout.groups[0]))) else 'column'}: {inner})"
    if layout.micro_batch is not None:
        at = "" if layout.factor == 1 else f" at {ratio_text(1 / layout.factor)}x"
        return f"each rank's own, against its micro-batch{at}" + \
            (" (of a loss divided by the micro-batch count)" if legit and layout.factor != 1 else "")
    if layout.passes > 1 and legit and layout.factor == Fraction(layout.passes, layout.world):
        # a rank's accumulated gradient (or a pass's loss divided by the number of passes) of a per-rank mean
        return f"{KINDS[layout.kind].name(layout)} (of micro-batch losses divided by their count)"
    return KINDS[layout.kind].family(layout, legit)


def why_scaled(layout: Layout, legit: tuple[Fraction, ...]) -> str:
    if not legit:  # what a correct run holds whole on every rank (what the optimizer makes) fits only as a sum
        return (f"{layout.describe()}, where a correct parallel run holds the same value (or its own shard of it) on "
                f"every rank: the ranks have parted from each other")
    right = min(legit, key=lambda f: abs(math.log(f / layout.factor)))
    times = right / layout.factor
    scale = ratio_text(times)
    if layout.passes > 1 and times in (layout.passes, Fraction(1, layout.passes)):
        # accumulation on the ranks: a rank sums its micro-batches' gradients, so each pass's loss, a mean over its
        # micro-batch, is divided by their number for the sum to be the mean over the rank's share
        how = "not divided by" if times > 1 else "divided twice by"
        return (f"{layout.describe()}: {scale}x what a correct parallel run holds here: each rank accumulates the "
                f"gradients of its {layout.passes} micro-batches (a sum), and the loss of each is {how} the number "
                f"of micro-batches ({layout.passes}), where the single process takes one mean over the global batch")
    powers = {Fraction(layout.world // layout.passes) ** k for k in range(-3, 4)}
    if times not in powers:  # no scale by the world size: the ranks' values are weighted otherwise
        return (f"{layout.describe()}: {scale}x what a correct parallel run holds here, a factor no scale by the "
                f"world size gives: per-rank values weighted differently from the reference's, such as means over "
                f"shards of unequal size averaged as if equal")
    return (f"{layout.describe()}: {scale}x what a correct parallel run holds here (a scale applied on every rank "
            f"that the single process does not apply: a loss or gradient scaled by the world size twice, or not "
            f"at all)")


def batch_warning_of(rop: OpRecord, m: Mapped, kind: Departure, producers: dict[int, int | None]) -> str | None:
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


def why_inputs(m: Mapped, step: int | None = None) -> str:
    at = "" if m.layout is None else f" ({m.layout.describe()})"
    head = (f"input {m.position} ({m.describe}) comes from outside the step and maps onto the reference's under no "
            f"layout at factor 1{at}")
    if earlier_step(step) is not None:
        return f"{head}: the runs had parted before step {step} (or began apart: initial weights, seed, global batch)"
    return f"{head}: the runs began apart (initial weights, seed, or not the same global batch)"
