"""Where a difference enters a trace whose every op replays clean.

A zoomed trace (``--module``/``--op``, full tensors) of the step where ``trend`` saw a change can replay clean: every
op in it computes right from the inputs it was given, and the change came in through an input that the trace did not
compute: a parameter written between steps, an activation made by an op the filter left out. Replay alone cannot say
which, so the evidence is the trace's own previous step (``trend`` prints a zoom-in of steps N-1..N for this).

Each recorded op's *external* inputs (written outside the trace, or by an op kept with statistics only) are scored
against the same input of the same op in the step before: the op is found by its position in the step (trend's
``Positions``), the input by its position in the op, and the score is trend's (``score_point``) with one value of
history: NaN/Inf appearing where there was none, or l2/absmax moving by the threshold's worth of log10 scale (4x at
the default of 12). An input that was all zeros the step before has no scale to jump from (a gradient buffer) and
is judged by NaN/Inf only. The optimizer's tensor inputs are left out: its state is its memory of earlier steps and
grows several-fold a step at first by design (AdamW's moments, measured on a 3-layer MLP: 4x from step 2 to 3); an
update gone wrong shows in the next step's forward, through the parameter it wrote. Its numeric arguments are
looked at instead (recorded for every op, also those the filter kept with statistics only): a learning rate raised
40x enters through the ``alpha`` of its ``add_`` (or the ``value`` of AdamW's ``addcdiv_``), by the same 4x
threshold, so that a schedule's small step-to-step changes are not an entry. The earliest such input or argument,
in op order, is where the difference enters; those after it are mostly its consequences (a larger output makes a
larger gradient).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from replaydiff.aten import is_cheap
from replaydiff.diff.pairs import tensor_stats
from replaydiff.replay import ReplayOptions
from replaydiff.replay.result import PROBLEMS, ReplayReport, Status
from replaydiff.replay.runner import computed_by
from replaydiff.trend.analysis import (DEFAULT_THRESHOLD, SCALE_FLOOR, Positions, left_out, ref_point, scalar_args,
                                       score_point, stats_point, why_left_out)
from replaydiff.trace import RankTrace, TensorRef, open_trace
from replaydiff.trace.schema import LEFT_OUT_FILTERED


@dataclass(frozen=True)
class Entry:
    """Input ``position`` of op ``index`` changed against the step before; it was written outside the trace
    (``producer`` None) or by op ``producer``, which the recording kept with statistics only. Or, with ``argument``
    (``position`` None, ``statistic`` "argument"), that non-tensor argument of an optimizer op changed."""

    rank: int
    step: int
    index: int
    op: str
    module: str | None
    phase: str | None
    position: int | None
    tensor: str | None  # e.g. float32[3, 16]
    producer: int | None
    statistic: str
    value: float
    previous: float
    previous_step: int
    producer_op: str | None = None  # the producer's op name
    producer_why: str | None = None  # why it counts as external: kept with statistics only, or a one-off op
    producer_source: str | None = None  # the producer's source line, FILE:LINE, where the trace has it
    argument: str | None = None  # the non-tensor argument that changed ("alpha"), for an optimizer op


def _point(r: RankTrace, ref: TensorRef) -> dict[str, float] | None:
    """An input's statistics: recorded ones (a statistics trace, a filtered op's), else those of its stored data."""
    p = ref_point(ref)
    if p is not None or not ref.stored or ref.meta or not ref.torch_dtype.is_floating_point:
        return p
    s = tensor_stats(r.tensor(ref))
    return None if s is None else stats_point(s)


def find_entry(r: RankTrace, threshold: float = DEFAULT_THRESHOLD) -> Entry | None:
    """The earliest external input of an op that changed against the step before (see the module docstring); None
    when the trace has fewer than two steps or nothing changed.

    An input written by a replayed op counts as external where that op is a one-off (it ran in no earlier step of
    the trace: a ``mul`` by 1e36 in the training loop at that step only). Replay judged it right from its inputs,
    yet it has no counterpart in the step before to be compared with, so what it wrote is compared, as the reader's
    input, with what the reader read there: the change is that op's doing. A view the recording left out (a ``t``
    outside an ``--op`` filter) computes nothing: an input it hands on is judged by the op that computed its
    value."""
    if _one_step(r) is not None:
        return None  # one numbered step: nothing to compare with (read no tensor to learn that)
    position = Positions()
    # op position -> (step, op number, {input: point}): the inputs' points are worked out when first asked for
    before: dict[tuple, tuple[int, int, dict[int, dict[str, float] | None]]] = {}
    args_before: dict[tuple, tuple[int, dict[str, Any]]] = {}  # optimizer op position -> (step, its arguments)
    first_seen: dict[tuple, int] = {}  # op position -> the first step it ran at
    one_off: set[int] = set()  # replayed ops that ran in no earlier step of the trace (not in its first step)
    first_step: int | None = None
    for op in r:
        if op.step is None:
            return None  # recorded with --step N: one step, no step before to compare with
        first_step = op.step if first_step is None else first_step
        if op.phase == "optimizer":
            key = position.key(op)
            args = scalar_args(op)
            prev = args_before.get(key)
            if prev is not None and prev[0] != op.step:
                for name, v in args.items():
                    w = prev[1].get(name)
                    if _argument_jumped(v, w, threshold):
                        return Entry(r.rank, op.step, op.index, op.name, op.module, op.phase, None, None, None,
                                     "argument", v, w, prev[0], argument=name)
            args_before[key] = (op.step, args)
        if left_out(op) or op.phase == "optimizer":
            # A filtered op was not replayed. An optimizer's state is its memory of earlier steps and grows several-
            # fold a step at first by design (AdamW's moments); a wrong update shows in the next step's forward,
            # where the parameter it wrote comes in.
            continue
        key = position.key(op)
        if first_seen.setdefault(key, op.step) == op.step and op.step != first_step:
            one_off.add(op.index)
        producers = r.producers(op.index)
        prev = before.get(key)
        for k, ref in enumerate(op.inputs()):
            prod = producers.get(k)
            writer = prod  # the op named as where it came from
            if prod is not None and left_out(r[prod]) and is_cheap(r[prod].name):
                computed = computed_by(r, prod)  # a view left out: what computed the value it hands on?
                if computed is not None and not left_out(r[computed]):
                    prod = writer = computed
            if prod is not None and not left_out(r[prod]) and prod not in one_off:
                continue  # computed inside the trace: replay judged the op that did it
            if prev is None or prev[0] == op.step:
                continue
            q = _earlier_point(r, prev, k)
            if q is None:
                continue
            p = _point(r, ref)
            if p is None:
                continue
            hit = score_point(p, [q], threshold, jumps=q["l2"] > 0)
            if hit is not None:
                w = None if writer is None else r[writer]
                return Entry(r.rank, op.step, op.index, op.name, op.module, op.phase, k, ref.describe(), writer,
                             hit[0], p[hit[0]], q[hit[0]], prev[0],
                             *((None, None) if w is None else (w.name, _why_external(w))),
                             producer_source=None if w is None else r.location(w).source)
        before[key] = (op.step, op.index, {})
    return None


def _earlier_point(r: RankTrace, prev: tuple[int, int, dict[int, dict[str, float] | None]],
                   k: int) -> dict[str, float] | None:
    """Input ``k``'s point of the op at the same position in the step before (read once, then kept)."""
    _, index, points = prev
    if k not in points:
        inputs = r[index].inputs()
        points[k] = _point(r, inputs[k]) if k < len(inputs) else None
    return points[k]


def _why_external(op: Any) -> str:
    """Why what op ``op`` wrote comes from outside what replay judged: the recording kept it with statistics only,
    or it ran in no earlier step (replayed, it computes right: the change is what its code asks for)."""
    if left_out(op):
        return why_left_out(op)
    return "which ran in no earlier step of this trace and replays right: the change is its doing"


def _argument_jumped(v: Any, w: Any, threshold: float) -> bool:
    """A numeric argument that changed from ``w`` (the step before) to ``v`` by the threshold's worth of log10
    scale (4x at the default), changed sign, or became zero, NaN or Inf (a learning rate schedule's small steps do
    not count)."""
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (v, w)) or v == w:
        return False
    if not (math.isfinite(v) and math.isfinite(w)) or (v == 0) != (w == 0) or (v < 0) != (w < 0):
        return True
    return v != 0 and abs(math.log10(abs(v)) - math.log10(abs(w))) >= threshold * SCALE_FLOOR


def _one_step(r: RankTrace) -> int | None:
    """The step number of a trace that holds exactly one (its first and last records have it), else None."""
    first = next(iter(r), None)
    if first is None or first.step is None:
        return None
    return first.step if r[len(r) - 1].step == first.step else None


def _judged_whole(report: ReplayReport, options: ReplayOptions) -> bool:
    """The replay ran over the whole trace (no --op, --from or --to) and found no op it judged wrong (ops whose data
    the recording left out are not judged; they make the replay not clean, but say nothing against the others)."""
    wrong = any(r.status in PROBLEMS or r.status is Status.ERROR for r in report.ops) or report.replicas is not None
    # ops missing from a damaged trace were not judged, and an entry found among the others could be wrong
    return not (wrong or report.missing or options.ops or options.first is not None or options.last is not None)


def _ranks(report: ReplayReport) -> list[int]:
    return sorted({res.rank for res in report.ops if res.status is not Status.SKIPPED})


@dataclass(frozen=True)
class EntryFinding:
    """What the trace's steps say of a replay: where a difference enters a trace whose every op replays clean
    (``entry``), or, for a clean replay of a zoom-in (a --module/--op filter) where none is found, why: it holds one
    numbered step (``one_step``: that step) or nothing changed by ``factor`` or more over ``steps`` (first, last)."""

    entry: Entry | None = None
    one_step: int | None = None
    steps: tuple[int, int] | None = None
    factor: float | None = None
    skipped: int = 0  # ops the replay could not judge (the line then speaks of those it did)


def entry_of_replay(trace: str, report: ReplayReport, options: ReplayOptions,
                    threshold: float = DEFAULT_THRESHOLD) -> EntryFinding:
    """Where the difference enters a trace whose replay judged every op and found none wrong, else what a zoom-in's
    clean replay could not see; an empty finding for any other replay."""
    skipped = report.counts()["skipped"]
    if not _judged_whole(report, options):
        return EntryFinding(skipped=skipped)
    t = open_trace(trace)
    ranks = _ranks(report)
    for rank in ranks:
        e = find_entry(t.rank(rank), threshold)
        if e is not None:
            return EntryFinding(entry=e, skipped=skipped)
    if not ranks or not any(r.data_left_out == LEFT_OUT_FILTERED for r in report.ops):
        return EntryFinding(skipped=skipped)  # a clean one-step trace of a whole step is a healthy step
    if report.nonfinite_origin is not None or report.nonfinite_entry is not None:
        return EntryFinding(skipped=skipped)  # replay's NaN/Inf line says where they begin: no "nothing changed"
    r = t.rank(ranks[0])
    step = _one_step(r)
    if step is not None:
        # one step after the first: the step before is needed to see where a difference comes in
        return EntryFinding(one_step=step if step >= 2 else None, skipped=skipped)
    first = next(iter(r), None)
    if first is None or first.step is None:
        return EntryFinding(skipped=skipped)
    return EntryFinding(steps=(first.step, r[len(r) - 1].step), factor=10 ** (threshold * SCALE_FLOOR),
                        skipped=skipped)
