"""Trends over a multi-step statistics trace: per-module series, the first sudden change, the op that made it and
the recording that looks closer (``compute_trend`` returns a ``TrendResult``; ``replaydiff.report.trend`` renders it).

Why a robust z-score: training statistics drift (norms grow, gradients shrink) and are noisy from batch to batch,
so a fixed threshold either fires every step or never. Each value is scored against the ``window`` steps before it:
``(log10 x - median) / max(1.4826 * MAD, 0.05)`` for norms and absmax (on a log scale, so a 100x jump scores the
same on a weight of 1e-3 and on an activation of 1e3; the 0.05-decade floor means a flat series must jump 4x to
reach the default threshold of 12), and for NaN/Inf counts any count above a window of zeros (the score is then the
count). The first change is the earliest step with a flagged value (sound evidence, below) and, inside it, the
earliest op: a change propagates forward through the step, so the first op that changes is where it entered.

Series are keyed by op *position*: (phase, module, op name, occurrence within that module in the step), which is the
same op step after step in a training loop without data-dependent control flow. A module's own series are its
output (the last forward op or ``module.output`` record in it) and its gradient (the last backward one that computes:
the detach AccumulateGrad makes of a parameter's gradient after the module's backward op is not the module's
gradient, and a conv's bias gradient before a batch norm is zero but for rounding). In module
granularity each parameter's ``module.param`` record is a series of its own: a weight spike that the module's
output hides (saturated gates, a norm layer after it) is plain there.

How much a score proves depends on how many values it was scored against. The threshold was measured on scores
against a full window of 10 steps; the median and MAD of fewer values are rougher estimates, so the same score says
less: for a spread estimated from n values a deviation's tail is (at least) Student's t with n - 1 degrees of
freedom, and the score a jump needs to be *sound* evidence is the threshold times t(n - 1) / t(9) at the 99.5th
percentile (``sound_score``: 17.0 against 5 steps, 14.9 against 6, 12.4 against 9). Median and MAD of few values
spread wider still (simulated on Gaussian noise, the 99th percentile of the score is 14.5 against 5 values and 4.95
against 10), so this is the least such a correction can be. Measured: in an 8-step flight window of a GNN whose loss
goes NaN at step 17, a 4x jump of a backward ``mm``'s absmax at step 15 scored 12.2 against 5 steps: noise (its
17-step series spans 10x, and against the 10 steps before it the same value scores 2.7). A jump above the threshold
but under that bound is *weak*: it is the first change only where the trace holds nothing sounder after it; where a
sound jump or NaN/Inf appearing (a count above a window of zeros: certain, whatever the history) follows, that is
the first change and the weak one is said to have been passed over (``TrendResult.passed_over``).

A fall is judged as a rise is, except in a gradient (backward) or the optimizer's tensors (made of gradients):
training shrinks gradients as it converges, and the norm of a small gradient (a bias's) wanders towards zero when
its parameter nears its optimum; on a log scale such a fall has no bound, and the window's median lags a series that
was already falling. So a fall there counts only when it goes to a tenth of the lowest value of its window or below
(zero included: a gradient gone, a path detached or a dead layer): measured on a converging conv net, a bias's
gradient fell 3.4x below its window's lowest value (z = -13.2 against the median): no change. In an output or a
parameter a fall counts as a rise does (a weight zeroed, activations collapsing). A gradient's rise, too, counts
only above twice the highest value of its window: a gradient's size varies with the batch's hard examples in a way
whose spread the window's median and MAD understate (most steps alike, a few large): measured on a healthy 60-step
GRU/LSTM seq2seq, a backward tanh's l2 at step 48 was 1.4x its window's highest and 5x its median (z = 12.2), and the
replay of the zoom-in found nothing. A gradient that explodes passes twice its highest at once.

What never counts as a change: statistics of integer and bool tensors (labels, token ids, indices: a batch whose
labels are all zeros has an l2 of 0, an infinite jump on a log scale) and of random ops' outputs (randint, dropout),
which differ every step by design.
"""
from __future__ import annotations

import fnmatch
import math
import os
import shlex
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any

from replaydiff import aten
from replaydiff.replay.flow import follow_nonfinite, stats_slots
from replaydiff.replay.runner import computed_by
from replaydiff.trace import RankTrace
from replaydiff.trace.schema import (LEFT_OUT_BUDGET, LEFT_OUT_DISK_FULL, LEFT_OUT_FILTERED, MODULE_PARAM, FlightDump,
                                     TensorRef, TensorStats, iter_refs)

STATISTICS = ("l2", "absmax", "nan", "inf")
LOG_FLOOR = 1e-30  # log10 of an exact zero
SCALE_FLOOR = 0.05  # decades: the smallest spread a window is taken to have
DEFAULT_WINDOW = 10
DEFAULT_THRESHOLD = 12.0  # measured: 60 steps of a tiny GPT-2, op by op, top noise score 9.5; a 100x weight 40
MIN_HISTORY = 5  # values needed before a step is scored
CALIBRATED_HISTORY = 10  # DEFAULT_THRESHOLD was measured on scores against this many steps (a full default window)
# Student's t, 99.5th percentile, by degrees of freedom (scipy.stats.t.ppf(0.995, df)): sound_score's correction
_T995 = {4: 4.604, 5: 4.032, 6: 3.707, 7: 3.499, 8: 3.355, 9: 3.250}
GRADIENT_FALL_DECADES = 1.0  # a gradient's fall counts from a tenth of its window's lowest value down
GRADIENT_RISE_DECADES = math.log10(2)  # a gradient's rise counts from twice its window's highest value up


def sound_score(threshold: float, history: int) -> float:
    """The |score| a jump scored against ``history`` values needs to be sound evidence (module docstring): the
    threshold against a full window, more against fewer values, as Student's t widens with fewer degrees of
    freedom."""
    if history >= CALIBRATED_HISTORY:
        return threshold
    df = max(history - 1, min(_T995))
    return threshold * _T995[df] / _T995[CALIBRATED_HISTORY - 1]


@dataclass(frozen=True)
class Change:
    step: int
    module: str | None
    op: str
    index: int  # op number in the trace
    phase: str | None
    statistic: str
    score: float
    value: float
    baseline: float  # median of the window before it
    parameter: str | None = None  # the parameter's name, for a module.param record
    history: int | None = None  # the values it was scored against (None: NaN/Inf made from finite inputs)
    sound: bool = True  # False: a jump under sound_score (weak evidence, see the module docstring)


@dataclass(frozen=True)
class Series:
    """One module's output or gradient, step by step (None where the step has no such op)."""

    module: str
    kind: str  # output | grad
    steps: list[int] = field(default_factory=list)
    values: dict[str, list[float | None]] = field(default_factory=lambda: {s: [] for s in STATISTICS})


@dataclass(frozen=True)
class TrendResult:
    rank: int
    steps: list[int]
    series: list[Series]
    first_change: Change | None
    window: int
    threshold: float
    module_glob: str | None
    ops_read: int
    cause: "Cause | None" = None
    # The first op (after the first step) that made NaN/Inf from finite inputs which no op keeps: they reach no
    # loss, gradient, parameter or output (a where over a log(0)). Said as information, never a change.
    discarded: Change | None = None
    command: tuple[str, ...] | None = None  # the command line the trace was recorded from (None: from Python)
    flight: FlightDump | None = None  # the flight recorder's dump (None: not a flight trace)
    command_dir: str | None = None  # the folder the command ran in (the job's working directory)
    # The earliest jump, weak evidence (too few values to score it against), that a sounder change after it outranked
    passed_over: Change | None = None
    unscored: "Unscored | None" = None  # records trend could not score (tensor data without statistics)

    @property
    def zoom(self) -> "Zoom | None":
        return None if self.first_change is None else Zoom.of(self.first_change, self.cause)

    @property
    def late_window(self) -> "LateWindow | None":
        """For a flight trace whose change is at the earliest step of the window where a change of its kind can be
        seen at all (NaN/Inf: the second step, against the first; a jump: the step after the MIN_HISTORY steps it is
        scored against), the window may have begun after the change did, which then hides in the steps it was
        compared with or before the window. Then: the --flight K that also keeps the ``window`` steps before the
        window. None otherwise (no change, not a flight trace, a change later in the window, or a window that
        starts at step 1)."""
        z, c, f = self.zoom, self.first_change, self.flight
        if z is None or c is None or f is None:
            return None
        held = self.steps  # those of the dump that hold records (a dump at exit lists the empty step in progress)
        first = held[0]
        nonfinite = c.statistic in ("nan", "inf")
        earliest = held[min(1 if nonfinite else MIN_HISTORY, len(held) - 1)]
        if z.step > earliest or first <= 1:
            return None
        gap = min((b - a for a, b in zip(held, held[1:])), default=1) or 1  # flight with --steps A-B:EVERY
        before = min(self.window, (first - 1) // gap)
        keep = max(f.keep or 0, len(held)) + before
        mib = None
        if f.dropped_for_budget and f.budget_mib:  # memory, not K, cut the window: it needs more of both
            mib = math.ceil(f.budget_mib * keep / len(held))
        return LateWindow(z.step, first, held[-1], nonfinite, f.keep, keep, before, f.budget_mib, mib,
                          f.dropped_for_budget)

    @property
    def cause_to_tell(self) -> "Cause | None":
        """The cause, where it says more than the first change: another op made it, or it entered through an
        input (the text report and the TUI's trend screen print it under the first change)."""
        c, cause = self.first_change, self.cause
        if c is None or cause is None or (cause.index == c.index and cause.how == "made" and not cause.from_finite
                                          and not cause.changed_args and cause.phase != "optimizer"):
            return None
        return cause


@dataclass(frozen=True)
class Unscored:
    """Records of the trace that hold tensor data without statistics, which trend does not read (a ``--tensors full``
    recording stores statistics only for the ops outside its ``--module``/``--op`` filter, or past its
    ``--budget``): a change in them is not seen, and the first change may be one they carried on. ``modules``: their
    modules ("-" for none); ``filter_modules``/``filter_ops``: the trace's record filter (None: none)."""

    records: int
    modules: tuple[str, ...]
    filter_modules: tuple[str, ...] | None
    filter_ops: tuple[str, ...] | None


class NoTrend(ValueError):
    """The trace has nothing ``trend`` can draw; the message says why and what would."""


class NoSteps(NoTrend):
    """The trace has no step numbers (recorded without ``--steps`` or ``--flight``)."""



def _located(r: RankTrace, op) -> dict:
    """An op's line and its text as every report gives them (trace/location.py): a backward op's is its forward
    op's, not the ``backward()`` call's."""
    where = r.location(op, text=True)
    return {"source": where.source, "source_text": where.source_text}

def ref_point(ref: TensorRef) -> dict[str, float] | None:
    """The statistics of a recorded floating-point tensor, as a series holds them (None: no statistics, or an
    integer or bool tensor: labels, token ids, indices have no scale to jump on, an l2 of 0 when a step's labels are
    all zeros)."""
    s = ref.stats
    if s is None or not ref.torch_dtype.is_floating_point:
        return None
    return stats_point(s)


def stats_point(s: TensorStats) -> dict[str, float]:
    """The statistics a series holds of a tensor."""
    return {"l2": s.l2, "absmax": s.absmax, "nan": s.nan, "inf": s.inf}


def _point(op: Any) -> dict[str, float] | None:
    """The statistics an op contributes to its series: those of its first floating-point output. A random op's
    outputs (randint labels, dropout masks) change every step by design: never a change."""
    if aten.is_random(op.name):
        return None
    return next((p for p in map(ref_point, op.outputs_refs()) if p is not None), None)


class Positions:
    """Each op's position in its step: (phase, module, op name, occurrence of those three in the step so far), the
    same op step after step in a training loop without data-dependent control flow. Ops are given in trace order.

    A view or detach computes nothing: its statistics are its input's, so it is the same op from step to step only
    when its input comes from the same op. Its key also holds the names of the ops that wrote its inputs: where a code
    path changes (a ``softmax`` and ``log`` in place of ``log_softmax``), the ``detach`` of the new path's tensor is
    not the ``detach`` of the old one's. Without a trace ``r`` the key leaves producers out (``report.entry`` looks
    for an input whose writer changed, so it must pair the op across that change)."""

    def __init__(self, r: RankTrace | None = None) -> None:
        self._step: int | None = None
        self._seen: dict[tuple, int] = {}
        self._r = r
        self._names: dict[int, str] = {}  # op number -> name, of the producers looked up

    def _producer_names(self, op: Any) -> tuple:
        if self._r is None:
            return ()
        names = []
        for prod in self._r.producers(op.index).values():
            if prod is None:
                names.append(None)
                continue
            name = self._names.get(prod)
            if name is None:
                name = self._names[prod] = self._r[prod].name
            names.append(name)
        return tuple(names)

    def key(self, op: Any) -> tuple:
        if op.step != self._step:
            self._step = op.step
            self._seen.clear()
        three = (op.phase, op.module, op.name) + ((self._producer_names(op),) if aten.is_cheap(op.name) else ())
        k = self._seen.get(three, 0)
        self._seen[three] = k + 1
        return (*three[:3], k) if len(three) == 3 else (*three[:3], k, three[3])


def compute_trend(r: RankTrace, module_glob: str | None = None, window: int = DEFAULT_WINDOW,
                  threshold: float = DEFAULT_THRESHOLD) -> TrendResult:
    """Series and the first sudden change of one rank's multi-step trace (NoSteps if it has no step numbers)."""
    # op position -> [(step, op number, name, point)]
    positions: dict[tuple, list[tuple[int, int, str, dict[str, float]]]] = {}
    # (module, kind) -> {step: point}; the last op of that phase in the module wins (in backward: the last computing)
    own: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    computed: set[tuple[str, int]] = set()  # (module, step) whose gradient came from an op that computes
    position = Positions(r)
    key_of: dict[int, tuple] = {}  # op number -> its position (what the walk back to the cause looks up)
    parameters: dict[int, str | None] = {}  # module.param record number -> the parameter's name
    steps: list[int] = []
    birth: Change | None = None  # the first op that made NaN/Inf from finite inputs (after the first step)
    discarded: Change | None = None  # the first that made NaN/Inf no op keeps (selected away): not a change
    current = None
    n = 0
    stepped = matched = 0  # ops with a step, and those of them the module filter keeps: why nothing is drawn
    modules: set[str] = set()
    unscored = 0  # records that hold tensor data without statistics: trend cannot see them
    unscored_modules: set[str] = set()
    for op in r:
        step = op.step
        if step is None:
            continue
        stepped += 1
        module = op.module
        if module_glob is not None and (module is None or not fnmatch.fnmatchcase(module, module_glob)):
            if module is not None and not matched:
                modules.add(module)
            continue
        matched += 1
        p = _point(op)
        if p is None:
            if _data_without_statistics(op):
                unscored += 1
                unscored_modules.add(module or "-")
            continue
        n += 1
        if step != current:
            current = step
            if not steps or steps[-1] != step:
                steps.append(step)
        key = key_of[op.index] = position.key(op)
        points = positions.setdefault(key, [])
        if birth is None and step != steps[0] and _makes_nonfinite(op, p, [q for *_, q in points[-window:]]):
            if _kept(r, op.index):
                birth = _birth(op, p)
            elif discarded is None:
                discarded = _birth(op, p)
        points.append((step, op.index, op.name, p))
        if op.name == MODULE_PARAM:
            parameters[op.index] = str(op.args[0]) if op.args else None
        elif module is not None and op.phase == "forward":
            own.setdefault((module, "output"), {})[step] = p
        elif module is not None and op.phase == "backward":
            # a detach or view (cheap) stands for the module only where its backward computed nothing (a Flatten)
            if not aten.is_cheap(op.name):
                computed.add((module, step))
            elif (module, step) in computed:
                continue
            own.setdefault((module, "grad"), {})[step] = p
    if not steps:
        raise _why_no_trend(r, stepped, matched, module_glob, modules)
    # NaN/Inf appearing that no op keeps are no change: the earliest change is followed forward, and if its NaN/Inf
    # are discarded they are left out and the earliest is sought again (one walk per discarded candidate, not one per
    # series: a NaN that spreads through the step shows in every series).
    discarded_at: set[int] = set()
    while True:
        first = weak = None  # the earliest sound change, the earliest weak one
        for (phase, module, name, *_), points in positions.items():
            c, sound = _first_change(points, phase, module, window, threshold, discarded_at)
            if sound is not None and (first is None or _at(sound) < _at(first)):
                first = sound
            if c is not None and not c.sound and (weak is None or _at(c) < _at(weak)):
                weak = c
        if first is None or first.statistic not in ("nan", "inf") or _kept(r, first.index):
            break
        discarded_at.add(first.index)
    made = birth is not None and (first is None or _at(birth) <= _at(first))
    if made:
        first = birth
    # A weak jump is the first change only where nothing sounder follows it (the module docstring)
    passed_over = None
    if weak is not None and first is None:
        first = weak
    elif weak is not None and _at(weak) < _at(first):
        passed_over = weak
    if passed_over is not None and passed_over.index in parameters:
        passed_over = replace(passed_over, parameter=parameters[passed_over.index])
    if first is not None and not made and first.index in parameters:
        first = replace(first, parameter=parameters[first.index])
    if made:
        # NaN/Inf appearing: the op that made it from finite inputs is the cause, whatever its history
        op = r[birth.index]
        cause = Cause(step=op.step, index=op.index, op=op.name, module=op.module, phase=op.phase, **_located(r, op),
                       how="made", statistic=birth.statistic, value=birth.value,
                      baseline=0.0, history=len(_History(positions, key_of, window).earlier(op.index)),
                      from_finite=True)
    else:
        cause = None if first is None else find_cause(r, first, _History(positions, key_of, window), threshold)
    series = [Series(module, kind, steps=list(steps),
                     values={name: [None if (p := by_step.get(st)) is None else p[name] for st in steps]
                             for name in STATISTICS})
              for (module, kind), by_step in sorted(own.items())]
    return TrendResult(r.rank, steps, series, first, window, threshold, module_glob, n, cause, discarded, r.command,
                       r.flight, r.source_root if r.command else None, passed_over,
                       Unscored(unscored, tuple(sorted(unscored_modules)), r.options.modules, r.options.ops)
                       if unscored else None)


def _data_without_statistics(op: Any) -> bool:
    """Whether an op that gives no point holds a floating-point output as tensor data without statistics (in a
    ``--tensors full`` trace, the ops of its --module/--op filter or within its --budget): trend scores statistics
    only, so it does not see this op."""
    return not aten.is_random(op.name) and any(
        ref.stats is None and ref.stored and not ref.zero and not ref.meta and ref.torch_dtype.is_floating_point
        for ref in op.outputs_refs())


def _at(c: Change) -> tuple[int, int]:
    """Where a change is in the trace: its step, then its op number (earlier first)."""
    return c.step, c.index


def _nonfinite(p: dict[str, float]) -> bool:
    return p["nan"] > 0 or p["inf"] > 0


def _makes_nonfinite(op: Any, p: dict[str, float], past: list[dict[str, float]]) -> bool:
    """Op ``op`` (output point ``p``) made NaN/Inf: its output has some, none of its floating-point inputs has any,
    and its own earlier steps (``past``; none for an op new in this step) had none (a mask filled with -inf every
    step is by design)."""
    if not _nonfinite(p) or any(_nonfinite(q) for q in past):
        return False
    return not any(q is not None and _nonfinite(q) for q in map(ref_point, op.inputs()))


def _kept(r: RankTrace, index: int) -> bool:
    """Do the NaN/Inf in op ``index``'s outputs reach the loss, a gradient, a parameter or an output of the step,
    followed forward by the statistics of the ops that read them (replay/flow.py)? NaN/Inf selected away (a where
    over a log(0), an additive -inf mask through softmax) are made and discarded: no change. True when the trace
    cannot tell."""
    return not follow_nonfinite(r, index, stats_slots).discarded


def _birth(op: Any, p: dict[str, float]) -> Change:
    statistic = "nan" if p["nan"] > 0 else "inf"
    return Change(op.step, op.module, op.name, op.index, op.phase, statistic, float(p[statistic]), p[statistic], 0.0)


def _why_no_trend(r: RankTrace, stepped: int, matched: int, module_glob: str | None,
                  modules: set[str]) -> NoTrend:
    """The true reason a trace gave no series: no step numbers, a --module filter that matched nothing, or no
    tensor statistics (a trace of tensor data or of shapes)."""
    if not stepped:
        return NoSteps("the trace has no step numbers: record it with --steps (or --flight)")
    if not matched:
        names = sorted(modules, key=lambda m: (m.count("."), m))  # the outermost first
        more = f" and {len(names) - 6} more" if len(names) > 6 else ""
        listed = f"its modules: {', '.join(names[:6])}{more}" if names else "its ops have no module"
        return NoTrend(f"--module {module_glob} matches no module of the trace ({listed})")
    tensors = r.options.tensors
    what = {"full": "tensor data (--tensors full)", "meta": "shapes and dtypes only (--tensors meta)"}.get(
        tensors or "", f"no tensor statistics (--tensors {tensors})")
    return NoTrend(f"the trace holds {what}, not the per-tensor statistics trend draws: record it with "
                   f"--tensors stats --steps A-B")


def log10_of(v: float) -> float:
    """log10 |v|, an exact zero or a NaN/Inf at LOG_FLOOR (the scale series are scored and drawn on)."""
    return math.log10(max(abs(v), LOG_FLOOR)) if math.isfinite(v) else math.log10(LOG_FLOOR)


def score_point(p: dict[str, float], past: list[dict[str, float]], threshold: float,
                jumps: bool = True, gradient: bool = False) -> tuple[str, float, float] | None:
    """The first statistic of ``p`` that is a sudden change against the values ``past`` (oldest first), as
    (statistic, score, baseline), else None. NaN/Inf appearing after finite values counts from one value of history;
    a jump of l2 or absmax (the robust z-score of the module docstring) only with ``jumps``. With ``gradient`` (a
    gradient's or the optimizer's tensor), a fall counts only to a tenth of the lowest value before it or below, a
    rise only to twice the highest or above (the module docstring)."""
    for s in ("nan", "inf"):
        if past and p[s] > 0 and all(q[s] == 0 for q in past):
            return s, float(p[s]), 0.0
    if not jumps or not past:
        return None
    for s in ("l2", "absmax"):
        logs = [log10_of(q[s]) for q in past]
        med = median(logs)
        mad = median(abs(x - med) for x in logs)
        now = log10_of(p[s])
        score = (now - med) / max(1.4826 * mad, SCALE_FLOOR)
        if score < 0 and gradient and now > min(logs) - GRADIENT_FALL_DECADES:
            continue  # a gradient shrinking as training converges
        if score > 0 and gradient and now < max(logs) + GRADIENT_RISE_DECADES:
            continue  # a gradient within twice the largest its window had: a batch's hard examples, not a change
        if abs(score) >= threshold:
            return s, round(score, 2), 10 ** med
    return None


def _first_change(points: list, phase: str | None, module: str | None, window: int, threshold: float,
                  discarded_at: set[int] | frozenset[int] = frozenset()) -> tuple[Change | None, Change | None]:
    """The first point of an op position's series that changes suddenly, and the first that is sound evidence (a
    jump of at least ``sound_score``, or NaN/Inf appearing; the same point where the first is sound); the NaN/Inf of
    the ops in ``discarded_at`` (selected away, see ``_kept``) do not count."""
    first = None
    for j in range(1, len(points)):
        step, index, name, p = points[j]
        if index in discarded_at:
            p = dict(p, nan=0, inf=0)
        past = [q for *_, q in points[max(0, j - window):j]]
        hit = score_point(p, past, threshold, jumps=j >= MIN_HISTORY, gradient=phase in ("backward", "optimizer"))
        if hit is None:
            continue
        statistic, score, baseline = hit
        sound = statistic in ("nan", "inf") or abs(score) >= sound_score(threshold, len(past))
        c = Change(step, module, name, index, phase, statistic, score, p[statistic], baseline, history=len(past),
                   sound=sound)
        first = first or c
        if sound:
            return first, c
    return first, None


# -- the cause: from the first change back to the op that made it ----------------------------------------------------
MAX_HOPS = 10_000  # producers come before their readers, so the walk ends anyway; this bounds a pathological one


@dataclass(frozen=True)
class Cause:
    """The op that made the first change (``how`` "made"): the first op upstream of it whose output is out of line
    while its inputs are not. Or, where the change was already in a tensor when the step read it (``how``
    "entered"): the op through whose input ``position`` it came in, written outside the trace (``producer`` None)
    or by op ``producer``, which the record filter left out. ``history``: the earlier steps the op was scored
    against; 0 for a one-off op (it ran in no earlier recorded step), scored instead against the earlier statistics
    of the tensor it wrote, as the ops that read that tensor saw it."""

    step: int | None
    index: int
    op: str
    module: str | None
    phase: str | None
    source: str | None
    how: str  # made | entered
    statistic: str
    value: float
    baseline: float
    history: int
    position: int | None = None
    producer: int | None = None
    source_text: str | None = None  # the source line's code, as recorded
    from_finite: bool = False  # it made NaN/Inf from inputs that had none
    changed_args: tuple[str, ...] = ()  # its non-tensor arguments that differ from earlier steps: "alpha=-10 (-0.01)"
    args_since: int | None = None  # the step from which those arguments have held their new values


def left_out(op: Any) -> bool:
    """Whether the recording kept this op with statistics only (outside the ``--module``/``--op`` filter, past the
    ``--budget``, or after the disk filled): replay does not judge it, so its outputs come from outside what the trace
    judges."""
    return op.data_left_out is not None


def why_left_out(op: Any) -> str:
    """The phrase for such an op in a sentence, e.g. 'which the record filter left out'."""
    return {LEFT_OUT_FILTERED: "which the record filter left out", LEFT_OUT_BUDGET: "whose data was past the budget",
            LEFT_OUT_DISK_FULL: "whose data the full disk left out"}.get(op.data_left_out, "whose data was left out")


@dataclass
class _History:
    """Where each op of the series sat (its position) and the points of every position, step by step."""

    positions: dict[tuple, list[tuple[int, int, str, dict[str, float]]]]
    key_of: dict[int, tuple]
    window: int

    def earlier(self, index: int) -> list[tuple[int, dict[str, float]]]:
        """(op number, point) of the op at the same position in the ``window`` steps before op ``index``."""
        key = self.key_of.get(index)
        if key is None:
            return []
        return [(i, q) for _, i, _, q in self.positions[key] if i < index][-self.window:]


def _numel(ref: TensorRef) -> int:
    return math.prod(ref.shape)


def find_cause(r: RankTrace, first: Change, history: _History, threshold: float) -> Cause:
    """Walk back from the first change to the op that made it.

    A change propagates forward, so the first op whose output jumps may only be carrying it: an ``addmm`` reads a
    weight that a ``mul_`` before it multiplied. At each op the walk scores its floating-point inputs against the
    same inputs of the op in earlier steps (its own history); an input out of line is followed to the op that
    wrote it in this step (the trace's producer edges: storage versions change on every write, so the producer is
    the last writer). A one-off op (no history: it runs in this step only, or too rarely) has its inputs of the
    followed tensor's size scored against the earlier statistics of that tensor: a ``mul_`` whose input is in line
    with the weight's past made the change. The walk stops at an op none of whose inputs is out of line (it made
    the change) or at an input written outside the trace or by a filtered op (the change entered there). NaN/Inf
    appearing are followed by their counts instead (``_nonfinite_cause``)."""
    if first.statistic in ("nan", "inf"):
        return _nonfinite_cause(r, first, history)
    op = r[first.index]
    followed = next(ref for ref in op.outputs_refs() if ref_point(ref) is not None)
    past = [q for _, q in history.earlier(first.index)]
    hit = (first.statistic, first.value, first.baseline)
    for _ in range(MAX_HOPS):
        earlier = history.earlier(op.index)
        inputs = op.inputs()
        past_inputs = [r[i].inputs() for i, _ in earlier] if len(earlier) >= MIN_HISTORY else None
        suspects = []  # (producer or -1, position, ref, its past, (statistic, value, baseline))
        producers = r.producers(op.index)
        for k, ref in enumerate(inputs):
            p = ref_point(ref)
            if p is None:
                continue
            if past_inputs is not None:
                its_past = [q for q in (ref_point(x[k]) for x in past_inputs if k < len(x)) if q is not None]
            elif _numel(ref) == _numel(followed):
                its_past = past
            else:
                continue  # a one-off op's other inputs have no past to be scored against
            found = score_point(p, its_past, threshold, jumps=len(its_past) >= MIN_HISTORY)
            if found is not None:
                prod = producers.get(k)
                suspects.append((-1 if prod is None else prod, k, ref, its_past, (found[0], p[found[0]], found[2])))
        common = dict(step=op.step, index=op.index, op=op.name, module=op.module, phase=op.phase, **_located(r, op),
                       history=len(earlier))
        if not suspects:
            before = [r[i] for i, _ in earlier]
            return Cause(**common, how="made", statistic=hit[0], value=hit[1], baseline=hit[2],
                         changed_args=changed_args(op, before), args_since=args_changed_at(op, before))
        # Inputs out of line from several writers: the earliest writer is where the change began.
        prod, k, ref, its_past, found = min(suspects, key=lambda x: (x[0], x[1]))
        writer = None if prod < 0 else r[prod]
        if writer is None:  # a writer the trace kept with statistics only (filtered, budget) has them: follow it
            return Cause(**common, how="entered", statistic=found[0], value=found[1], baseline=found[2],
                         position=k, producer=None)
        op, followed, past, hit = writer, ref, its_past, found
    return Cause(step=op.step, index=op.index, op=op.name, module=op.module, phase=op.phase, **_located(r, op),
                  how="made", statistic=hit[0], value=hit[1], baseline=hit[2], history=0)


def _nonfinite_cause(r: RankTrace, first: Change, history: _History) -> Cause:
    """Where NaN/Inf that no op made from finite inputs in a scored step (``compute_trend``'s birth) come from: the
    first op to show them may only carry them. The walk follows the inputs whose statistics hold NaN/Inf back to
    the ops that wrote them (through views and other ops that compute no new value, as replay does: ``computed_by``)
    and stops at an op none of whose inputs holds any (it made them: "made") or at an input written outside the
    trace (the batch, a tensor written outside the dispatcher: "entered" through that input). Of several such
    inputs, one from outside the trace first, then the one of the earliest writer. A writer the recording kept
    with statistics only (outside a --module filter) has them, so the walk goes on through it."""
    op = r[first.index]
    for _ in range(MAX_HOPS):
        producers = r.producers(op.index)
        held = []  # (writer, or -1 for outside the trace; input position; its point)
        for k, ref in enumerate(op.inputs()):
            p = ref_point(ref)
            if p is not None and _nonfinite(p):
                writer = computed_by(r, producers.get(k))
                held.append((-1 if writer is None else writer, k, p))
        common = dict(step=op.step, index=op.index, op=op.name, module=op.module, phase=op.phase, **_located(r, op),
                       history=len(history.earlier(op.index)), baseline=0.0)
        if not held:
            p = _point(op)
            s = first.statistic if p is None or not _nonfinite(p) else ("nan" if p["nan"] > 0 else "inf")
            return Cause(**common, how="made", statistic=s,
                         value=p[s] if p is not None and _nonfinite(p) else first.value, from_finite=True)
        writer, k, p = min(held, key=lambda h: (h[0], h[1]))
        if writer < 0:
            s = "nan" if p["nan"] > 0 else "inf"
            return Cause(**common, how="entered", statistic=s, value=p[s], position=k, producer=None)
        op = r[writer]
    return Cause(step=op.step, index=op.index, op=op.name, module=op.module, phase=op.phase, **_located(r, op),
                  how="made", statistic=first.statistic, value=first.value, baseline=0.0,
                 history=0)


def scalar_args(op: Any) -> dict[str, Any]:
    """An op's arguments that hold no tensor, by name ("arg K" for a positional one)."""
    named = {f"arg {k}": v for k, v in enumerate(op.args)} | dict(op.kwargs)
    return {k: v for k, v in named.items() if next(iter_refs(v), None) is None}


def changed_args(op: Any, earlier: list[Any]) -> tuple[str, ...]:
    """Op ``op``'s non-tensor arguments whose value differs from the ``earlier`` steps' ops at its position, as
    "name=value (value before)" where it had that value in none of them, or "name=value from step S on (value
    before)" where it took that value at step S and kept it: the optimizer's ``add_`` with ``alpha=-10.0`` where it
    was ``-0.01`` (a learning rate changed) made a change that no input shows, and an update's effect can show a step
    after the learning rate changed."""
    out = []
    for name, v, before, since in _arg_changes(op, earlier):
        out.append(f"{name}={v!r} ({before!r} before)" if since == op.step else
                   f"{name}={v!r} from step {since} on ({before!r} before)")
    return tuple(out)


def args_changed_at(op: Any, earlier: list[Any]) -> int | None:
    """The earliest step from which op ``op``'s changed non-tensor arguments (``changed_args``) have held their
    value; None when none changed."""
    return min((since for *_, since in _arg_changes(op, earlier) if since is not None), default=None)


def _arg_changes(op: Any, earlier: list[Any]) -> list[tuple[str, Any, Any, int | None]]:
    """(name, value, the value before, the step it took this value) of each changed non-tensor argument."""
    past = [(e.step, scalar_args(e)) for e in earlier]
    out = []
    for name, v in scalar_args(op).items():
        before = [(step, a[name]) for step, a in past if name in a]
        if not before or before[-1][1] == v and all(b == v for _, b in before):
            continue
        if all(b != v for _, b in before):
            out.append((name, v, before[-1][1], op.step))
            continue
        k = max(i for i, (_, b) in enumerate(before) if b != v)  # the last step with another value
        out.append((name, v, before[k][1], before[k + 1][0] if k + 1 < len(before) else op.step))
    return out


# -- the next command: a closer look at the change -------------------------------------------------------------------
@dataclass(frozen=True)
class Zoom:
    """The recording that looks closer at a change: full tensors of its step and the step before (replay compares
    what enters the trace across the two, see docs/replay.md), with a filter that holds both the cause and the first
    change (the op trend names as the cause must be in the recording it suggests, or replay can only say that the
    change came from an op it did not see): the modules they are in (``--module``, one or two), or, where either
    runs outside any module (a ``mul`` in the training loop: ``--module`` never selects such an op, and the
    ``--module``/``--op`` filters must both match), their op names (``--op``). Where the cause is an op whose
    arguments took new values at an earlier step (a learning rate raised a step before its update showed), that
    step and the one before it; the first change, a step later, is then outside those steps and not held."""

    steps: str
    modules: list[str] | None
    ops: list[str] | None
    step: int  # the step of the change (the last of ``steps``)

    @classmethod
    def of(cls, first: Change, cause: Cause | None) -> "Zoom":
        step = cause.step if cause is not None and cause.step is not None else first.step
        if cause is not None and cause.args_since is not None and cause.args_since < step:
            step = cause.args_since  # an argument (a learning rate) changed there: replay names it across the two
        steps = f"{step - 1}-{step}" if step > 1 else f"{step}"
        held = [] if cause is None else [(cause.module, cause.op)]
        if first.step in (step - 1, step):  # the first change is among the zoomed steps: hold it too
            held.append((first.module, first.op))
        modules = list(dict.fromkeys(m for m, _ in held))
        if None not in modules:
            return cls(steps, modules, None, step)
        # An op outside every module: the op names select it (module granularity has no such records: its records
        # all have a module, so these are aten op names)
        return cls(steps, None, list(dict.fromkeys(name for _, name in held)), step)

    def out(self, trace: str) -> str:
        return f"{trace.rstrip('/')}-step{self.steps.rsplit('-', 1)[-1]}"

    def record_options(self, trace: str) -> str:
        """The record command up to its ``--``, which the job's command follows."""
        filters = "".join(f" --module {shlex.quote(m)}" for m in self.modules or []) + \
            "".join(f" --op {shlex.quote(o)}" for o in self.ops or [])
        return f"replaydiff record --tensors full --steps {self.steps}{filters} -o {shlex.quote(self.out(trace))} --"

    def commands(self, trace: str, command: tuple[str, ...] | list[str] | None = None,
                 command_dir: str | None = None) -> dict[str, str | None]:
        """The record command (None where the job's ``command`` is not known: a trace recorded from Python), the
        replay command and the record call in Python. A command that ran in another folder (``command_dir``) than
        this one is run there (``cd DIR && ...``), its trace named by its absolute path."""
        record = None
        if command:
            record = f"{self.record_options(trace)} {shlex.join(command)}"
            if command_dir and os.path.abspath(command_dir) != os.getcwd():
                trace = os.path.abspath(trace)
                record = f"cd {shlex.quote(command_dir)} && {self.record_options(trace)} {shlex.join(command)}"
        out = shlex.quote(self.out(trace))
        which = "modules" if self.modules else "ops"
        return {"record": record,
                "replay": f"replaydiff replay {out}",
                "python": f"replaydiff.record({self.out(trace)!r}, tensors='full', steps={self.steps!r}, "
                          f"{which}={self.modules or self.ops!r})"}


@dataclass(frozen=True)
class LateWindow:
    """A flight window (steps ``first``..``last``) that may have begun after the change: the change, at ``step``,
    is at the earliest step of the window where one of its kind can be seen (TrendResult.late_window). ``keep``: the
    --flight K that also holds the ``before`` steps ahead of the window; ``mib``: the --flight-mib that holds them,
    where memory (not K) dropped older steps."""

    step: int
    first: int
    last: int
    nonfinite: bool  # the change is NaN/Inf appearing (else a jump of l2 or absmax)
    was: int | None  # the --flight K recorded with
    keep: int
    before: int
    was_mib: float | None
    mib: int | None
    dropped: int
