"""A run on some rows of another run's batch, mapped onto those rows: the first op where the rows part, and why.

SMALL is the same step on a run of BIG's rows (bs=1 against bs=8, a sampler's batch against its trainer's). Its step
input is found among BIG's rows (the rows ``r0 .. r0+b``), BIG's batch is followed through its data flow as the
check does (``analysis.walk_batch``, which also runs each of BIG's ops on exactly those rows), and the two runs' ops
are paired in order. For each pair, every output of BIG's op that holds the batch is cut to those rows and compared
bit for bit with SMALL's; outputs without the batch (the loss, a weight gradient) are sums over different batches
and are not compared. The first op whose inputs agree on the rows and whose outputs do not is where the rows part;
the check of that op on those rows says why (its kernel depends on the batch, or a mean divides by it), or that the
batch does not explain it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from replaydiff import aten
from replaydiff.compare.metrics import ExactMismatch, measure
from replaydiff.invariance.analysis import NoBatch, recorded_device, step_input, walk_batch
from replaydiff.invariance.batch import BatchDim
from replaydiff.invariance.result import OpCheck, Rows
from replaydiff.invariance.walk import BatchWalk, ulp_distance
from replaydiff.replay.compared import VALUES, compared_outputs
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import OpRecord, TensorRef


@dataclass(frozen=True)
class RowsPart:
    """A pair of ops whose outputs differ on the rows."""

    big: int  # BIG's op number
    small: int  # SMALL's op number
    op: str
    module: str | None
    phase: str | None
    source: str | None
    output: str
    mismatches: int
    elements: int
    max_ulps: int
    inputs_agree: bool
    cause: OpCheck | None  # BIG's op checked on exactly these rows: Finding.VARIANT says its kernel depends on them


@dataclass(frozen=True)
class RowsDiff:
    big_batch: int
    small_batch: int
    rows: Rows  # SMALL's rows among BIG's
    pairs: int  # ops paired
    compared: int  # pairs with an output holding the batch, compared on the rows
    parted: RowsPart | None  # the first pair whose inputs agree on the rows and outputs do not
    first_difference: RowsPart | None  # the first pair whose outputs differ at all
    pairing_ends: str | None  # why the pairing stopped before the end of either run, if it did


def diff_rows(big: RankTrace, small: RankTrace, device: str | None = None,
              progress: Callable[[int, int], None] | None = None) -> RowsDiff:
    """Map SMALL onto its rows of BIG (module docstring). NoBatch when SMALL's step input is not rows of BIG's."""
    rows, b_big = _rows_of(big, small)
    walk = walk_batch(big, b_big, (rows,), device or recorded_device(big), progress)
    checks = {c.index: c for c in walk.checks}
    pairing = _Pairing(walk, small, rows)
    pairs = compared = 0
    parted = first = None
    ends = None
    for bo, so in zip(_ops(big), _ops(small)):
        if bo.name != so.name:
            ends = f"the runs' ops differ at BIG #{bo.index} {bo.name} / SMALL #{so.index} {so.name}"
            break
        pairs += 1
        outs = pairing.differences(bo, so)
        if outs is None:
            continue
        compared += 1
        if not outs:
            continue
        agree = pairing.inputs_agree(bo, so)
        label, mism, elements, ulps = outs[0]
        part = RowsPart(big=bo.index, small=so.index, op=bo.name, module=bo.module, phase=bo.phase, source=bo.source,
                        output=label, mismatches=mism, elements=elements, max_ulps=ulps, inputs_agree=agree,
                        cause=checks.get(bo.index))
        first = first or part
        if agree:
            parted = part
            break
    return RowsDiff(big_batch=b_big, small_batch=rows.stop - rows.start, rows=rows, pairs=pairs, compared=compared,
                    parted=parted, first_difference=first, pairing_ends=ends)


def _rows_of(big: RankTrace, small: RankTrace) -> tuple[Rows, int]:
    """SMALL's rows among BIG's, found by its step input, and BIG's batch size."""
    found_big = step_input(big, None)
    if found_big is None:
        raise NoBatch("BIG: no step input found to read its batch from")
    b_ref = found_big[0]
    found_small = step_input(small, None, like=b_ref, min_rows=1)
    if found_small is None:
        raise NoBatch(f"SMALL has no step input shaped as BIG's {b_ref.describe()} but for its rows")
    s_ref = found_small[0]
    b, n = s_ref.shape[0], b_ref.shape[0]
    if b >= n:
        raise NoBatch(f"SMALL's batch ({b} rows) is not smaller than BIG's ({n})")
    s_t, b_t = small.tensor(s_ref), big.tensor(b_ref)
    for r0 in range(n - b + 1):
        if torch.equal(b_t.narrow(0, r0, b), s_t):
            return Rows(r0, r0 + b), n
    raise NoBatch(f"SMALL's step input {s_ref.describe()} is not a run of rows of BIG's {b_ref.describe()}")


def _ops(rt: RankTrace) -> Any:
    """The ops that compute something to pair: recorded, not markers, of the forward and the backward."""
    for op in rt:
        if op.recorded and not aten.is_marker(op.name) and op.phase in ("forward", "backward"):
            yield op


def _tensor_refs(op: OpRecord) -> list:
    return [c for c in compared_outputs(op, True) if c.how == VALUES and isinstance(c.recorded, TensorRef)]


class _Pairing:
    """BIG's walk, SMALL's trace and the rows: what comparing a pair of ops on the rows needs."""

    def __init__(self, walk: BatchWalk, small: RankTrace, rows: Rows) -> None:
        self.walk, self.small, self.span = walk, small, (rows.start, rows.stop)

    def big_rows(self, ref: TensorRef) -> torch.Tensor | None:
        """BIG's recorded tensor cut to the rows; None when it does not hold the batch."""
        d: BatchDim | None = self.walk.dim(ref)
        if d is None:
            return None
        start, length = d.span(self.span)
        return self.walk.rt.tensor(ref).narrow(d.dim, start, length)

    def differences(self, bo: OpRecord, so: OpRecord) -> list[tuple[str, int, int, int]] | None:
        """(output, mismatches, elements, max ULPs) of each output holding the batch whose rows differ; None when
        the op has no output holding the batch to compare."""
        found: list[tuple[str, int, int, int]] = []
        any_compared = False
        for bc, sc in zip(_tensor_refs(bo), _tensor_refs(so)):
            mine = self.big_rows(bc.recorded)
            if mine is None:
                continue
            theirs = self.small.tensor(sc.recorded)
            if tuple(theirs.shape) != tuple(mine.shape):
                continue
            any_compared = True
            m = measure(mine, theirs, exact=True)
            n = m.mismatches if isinstance(m, ExactMismatch) else mine.numel()
            if n:
                ulps = ulp_distance(mine, theirs) if mine.dtype.is_floating_point and mine.dtype == theirs.dtype else 0
                found.append((bc.label, n, mine.numel(), ulps))
        return found if any_compared else None

    def inputs_agree(self, bo: OpRecord, so: OpRecord) -> bool:
        """Whether every tensor input of SMALL's op is BIG's on the rows (the whole of it, for one without the
        batch)."""
        b_ins, s_ins = bo.inputs(), so.inputs()
        if len(b_ins) != len(s_ins):
            return False
        for br, sr in zip(b_ins, s_ins):
            if not (br.stored_data and sr.stored_data):
                continue
            mine = self.big_rows(br)
            if mine is None:
                mine = self.walk.rt.tensor(br)
            theirs = self.small.tensor(sr)
            if tuple(mine.shape) != tuple(theirs.shape):
                return False
            m = measure(mine, theirs, exact=True)
            if not isinstance(m, ExactMismatch) or m.mismatches:
                return False
        return True
