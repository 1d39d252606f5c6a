"""The batch-invariance check of a full trace: each op that reads the batch, re-run on slices of it.

The step's batch is read from its inputs (the forward's tensors that no op made and that need no gradient), then
every op is taken in recorded order by a ``walk.BatchWalk``, which follows the batch and runs each op that reads it
on one row and on the first half, at its recorded dtypes on the recording backend with the recorded thread count,
comparing bit for bit with the same rows of the recorded output. Any difference means the op's kernel computes a row
differently with the rest of the batch there: the op is batch-variant. Each op is fed its own recorded inputs, so an
op downstream of a variant one is judged on its own, as replay judges ops. Each variant op is then followed to the
step's outputs it reaches, and the ops are summed up per kind with what to do.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from replaydiff import aten
from replaydiff.invariance.advice import advice_for
from replaydiff.invariance.batch import could_be_batch, is_step_input, makes_batch
from replaydiff.invariance.result import Finding, InvarianceResult, KindSummary, OpCheck, Rows, StepOutput
from replaydiff.invariance.walk import BatchWalk
from replaydiff.replay.engine import replay_threads
from replaydiff.replay.policy import Precision, ReplayOptions, reference_settings
from replaydiff.replay.runner import OpReplayer
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import TensorRef

FIRST = 3  # variant calls named per kind of op in the summary


class NoBatch(Exception):
    """The trace shows no input the batch could be read from; the message says what to give instead."""


def check_invariance(rt: RankTrace, batch_size: int | None = None, device: str | None = None,
                     progress: Callable[[int, int], None] | None = None) -> InvarianceResult:
    """Check every op of the rank's trace on slices of the batch. ``batch_size``: the step's batch (default: the
    first dimension of the first input of the forward that no op made and that needs no gradient); ``device``: where
    to run (default: where the trace was recorded)."""
    found = find_batch(rt, batch_size)
    if found is None:
        raise NoBatch("no step input found to read the batch from (a tensor of the forward that needs no gradient, "
                      "made by no op or by a collation or random factory of the step"
                      + (f", with {batch_size} rows" if batch_size else "") + ")")
    ref, where = found
    b = ref.shape[0]
    if b < 2:
        raise NoBatch(f"the batch has {b} row: there is no smaller slice to compare (record a step with a larger "
                      f"batch)")
    rows = (Rows(0, 1),) + ((Rows(0, b // 2),) if b // 2 > 1 else ())
    device = device or recorded_device(rt)
    walk = walk_batch(rt, b, rows, device, progress, ref)
    threads = walk.threads
    checks = tuple(walk.checks)
    if any(c.finding is Finding.VARIANT for c in checks):
        outputs = _step_outputs(rt)
        checks = tuple(_with_reach(rt, c, outputs) if c.finding is Finding.VARIANT else c for c in checks)
    return InvarianceResult(rank=rt.rank, batch_size=b, batch_input=where, rows=rows, device=device,
                            threads=threads, checks=checks, kinds=_kinds(checks))


def walk_batch(rt: RankTrace, batch: int, rows: tuple[Rows, ...], device: str,
               progress: Callable[[int, int], None] | None = None, batch_input: TensorRef | None = None
               ) -> "BatchWalk":
    """Every op of the rank's trace taken in order, the batch followed and each op that reads it run on ``rows``;
    ``batch_input``: the batch as ``find_batch`` found it (a tensor the step made is no step input to the walk)."""
    opts = ReplayOptions(device=device, precision=Precision.SAME)
    threads = replay_threads(rt, opts)
    walk = BatchWalk(rt, OpReplayer(rt, opts), batch, rows, threads,
                     None if batch_input is None else batch_input.version)
    total = len(rt)
    with reference_settings(threads), torch.inference_mode():
        for op in rt:
            walk.op(op)
            if progress is not None:
                progress(op.index + 1, total)
    return walk


def find_batch(rt: RankTrace, batch_size: int | None) -> tuple[TensorRef, str] | None:
    """The step's batch (with ``batch_size`` rows, when given) and where it was read: what the model's first op
    reads (the forward's first op of a module that reads a tensor needing no gradient), where that could be the
    batch, a step input or a tensor the step made (``makes_batch``: a DataLoader's collation, a ``randn``); else the
    forward's first step input; else the first such tensor made in the step. A tensor read only to take rows out of
    it (a dataset a collation indexes) is not the batch: its rows are."""
    produced: set = set()
    made: set = set()
    first_input = first_made = None
    model_read = False  # the model's first op that reads a tensor other than a parameter was seen
    for op in rt:
        if op.phase == "forward" and not aten.is_marker(op.name):
            ins = op.inputs()
            for k, r in enumerate(ins):
                if not could_be_batch(r, batch_size) or r.version is None:
                    continue
                outside, inside = r.version not in produced, r.version in made
                if not (outside or inside):
                    continue
                if outside and aten.takes_a_row(op.name):
                    continue  # a row taken out of it, as a collation indexes a dataset
                where = f"op #{op.index} {op.name} input {k} {r.describe()}, dimension 0" + (
                    "" if outside else " (made in the step)")
                if op.module and not model_read:
                    return r, where
                if outside and first_input is None:
                    first_input = (r, where)
                if inside and first_made is None:
                    first_made = (r, where)
            if op.module and any(not r.requires_grad for r in ins):
                model_read = True
            if makes_batch(op):
                made.update(r.version for r in op.outputs_refs())
        produced.update(r.version for r in op.outputs_refs())
        if op.phase not in (None, "forward"):
            break
    return first_input or first_made


def step_input(rt: RankTrace, batch_size: int | None, like: TensorRef | None = None, min_rows: int = 2
               ) -> tuple[TensorRef, str] | None:
    """The first step input of the forward (or the first with ``batch_size`` rows, or the first of ``like``'s dtype
    and shape but for its rows), and where it was read."""
    produced: set = set()
    for op in rt:
        if op.phase == "forward" and not aten.is_marker(op.name):
            for k, r in enumerate(op.inputs()):
                if is_step_input(r, produced, batch_size, min_rows) and (
                        like is None or (r.dtype == like.dtype and r.shape[1:] == like.shape[1:])):
                    return r, f"op #{op.index} {op.name} input {k} {r.describe()}, dimension 0"
        produced.update(r.version for r in op.outputs_refs())
        if op.phase not in (None, "forward"):
            break
    return None


def recorded_device(rt: RankTrace) -> str:
    """The device the trace's ops wrote their outputs on (the recording backend)."""
    for op in rt:
        for r in op.outputs_refs():
            if isinstance(r.device, str) and r.device != "meta":
                return r.device
    return "cpu"


# -- where a difference goes, and the summary ---------------------------------------------------------------------
def _step_outputs(rt: RankTrace) -> dict[str | None, set[int]]:
    """The ops whose results are the step's outputs, per phase: of the forward, the loss (what a backward is started
    from: the op a ``ones_like`` reads) or, with no backward, the last op that computes; of the backward, the
    gradients (what the optimizer reads)."""
    idx = rt.index
    outs: dict[str | None, set[int]] = {"forward": set(), "backward": set()}
    last_forward = None
    for i in range(len(idx)):
        phase = idx.phase[i]
        if phase == "forward" and not idx.cheap[i] and idx.recorded[i]:
            last_forward = i
        for js in idx.consumers(i).values():
            for j in js:
                if phase == "forward" and not aten.reads_values(idx.name[j]) and any(
                        idx.phase[k] == "backward" for ks in idx.consumers(j).values() for k in ks):
                    outs["forward"].add(i)
                elif phase == "backward" and idx.phase[j] == "optimizer":
                    outs["backward"].add(i)
    if not outs["forward"] and last_forward is not None:
        outs["forward"].add(last_forward)
    return outs


def _with_reach(rt: RankTrace, c: OpCheck, outputs: dict[str | None, set[int]]) -> OpCheck:
    """The check with the step's outputs of its phase (``_step_outputs``) its result flows into, through the data
    flow within the phase."""
    idx = rt.index
    targets = outputs.get(c.phase, set())
    seen = {c.index}
    todo = [c.index]
    while todo:
        i = todo.pop()
        for js in idx.consumers(i).values():
            for j in js:
                if j not in seen and idx.phase[j] == c.phase and aten.reads_values(idx.name[j]):
                    seen.add(j)
                    todo.append(j)
    reached = tuple(StepOutput(i, idx.name[i], idx.module[i]) for i in sorted(seen & targets))
    return OpCheck(c.index, c.op, c.module, c.phase, c.source, c.finding, c.reason, c.diffs, reached)


def _kinds(checks: tuple[OpCheck, ...]) -> tuple[KindSummary, ...]:
    by: dict[str, list[OpCheck]] = defaultdict(list)
    for c in checks:
        if c.finding.judged:
            by[c.op].append(c)
    kinds = []
    for name, cs in by.items():
        bad = [c for c in cs if c.finding is Finding.VARIANT]
        kinds.append(KindSummary(op=name, invariant=len(cs) - len(bad), variant=len(bad),
                                 advice=advice_for(name) if bad else None, first=tuple(bad[:FIRST])))
    return tuple(sorted(kinds, key=lambda k: (-k.variant, -k.invariant, k.op)))
