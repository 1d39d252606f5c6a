"""Comparing aligned op pairs of two traces: inputs and outputs judged with replay's judging function and limits.

A tensor pair is compared on the best evidence both traces hold: full tensors through ``compare.measure`` and
``compare.judge_measure`` (the same per-dtype limits as replay, scaled for the op's reduction length), or, for
``stats`` traces, through the recorded statistics. Statistics cannot give the error itself, only lower bounds on it
(``|l2_a - l2_b|``, ``|mean_a - mean_b|*sqrt(n)`` and ``|std_a - std_b|*sqrt(n)`` are each at most ``|a - b|_2``;
``|absmax_a - absmax_b|`` is at most ``max|a - b|``), so a difference they show is real, and one they miss is
reported as "statistics only" evidence.

When the two sides hold different dtypes (autocast on one side), the coarser dtype decides the limits: it is the side
whose rounding explains the difference.

An op pair is ``divergent`` when its inputs (tensors and plain arguments) agree and its outputs do not: the op that
introduced the difference. ``inherited`` when an input already differed; its origin is the producer of the first
differing input (an aligned pair, an op on one side only, or outside the trace). Also ``inherited`` when its inputs
agree only within tolerance and descend from a step input (parameter, optimizer state, batch, buffer) that already
differed beyond it: the difference came in with the step, the op carried it on. Inputs equal bit for bit always make
the op the cause, unless each side's op is right given its own inputs.

The fixed limits are made for one rounding of a value the size of the output; an output whose size is set by
cancellation (the mean of an input already centred) or a difference carried through many ops (bf16 against fp32)
breaks them with no op at fault. So a pair that would be ``divergent`` and whose tensors both traces hold is judged
once more: each side's op is replayed alone from its own recorded inputs, as replay does (its calibration scales
an ill-conditioned op's limit by its own error at its dtype). Both right: the pair is ``same`` (``explained``), and
its outputs count as agreeing for the ops that read them. One wrong: it stays ``divergent``, and says which side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from replaydiff import aten
from replaydiff.compare.metrics import ExactMismatch, FloatError, Measure, NonfiniteMismatch, ShapeMismatch, measure
from replaydiff.compare.notes import Note, render, verdict_reason
from replaydiff.compare.tolerance import Tolerances, reduction_length
from replaydiff.compare.verdict import OutputName, Verdict, judge_measure
from replaydiff.diff.notes import (CarriedFromStep, DiffFact, InputDiffered, PlainArgsDiffer, RightGivenOwnInputs,
                                   TensorInputCount, WrongGivenOwnInputs)
from replaydiff.diff.result import Evidence, Origin, OriginKind, PairResult, PairStatus, weakest
from replaydiff.replay.compared import output_names
from replaydiff.replay.policy import ReplayOptions
from replaydiff.replay.result import OpResult, Status
from replaydiff.replay.runner import OpReplayer
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema.ops import OpRecord
from replaydiff.trace.schema.values import Opaque, TensorRef, TensorStats, iter_refs

# Where a tensor sits in an op, for per-op limits in baseline mode: (ref op number, "in" | "out", position).
Where = tuple[int, str, int]


@dataclass(frozen=True)
class Compared:
    evidence: Evidence
    measure: Measure | None  # None: shapes only, and they agree
    dtype: str  # the dtype whose limits apply (the coarser side's)


def _eps(dtype: str) -> float:
    try:
        return torch.finfo(getattr(torch, dtype)).eps
    except (TypeError, AttributeError):
        return 0.0


def tensor_stats(x: torch.Tensor) -> TensorStats | None:
    """The statistics a ``stats`` trace records (over finite values, in float64); None for complex tensors."""
    if x.is_complex():
        return None
    v = x.detach().reshape(-1).to(torch.float64)
    finite = torch.isfinite(v)
    nan = int(torch.isnan(v).sum())
    inf = int(v.numel() - int(finite.sum()) - nan)
    f = v[finite]
    if f.numel() == 0:
        return TensorStats(v.numel(), 0.0, 0.0, 0.0, 0.0, nan, inf)
    n = f.numel()
    mean = float(f.sum()) / n
    l2 = float(torch.linalg.vector_norm(f))
    # The recorder's formula for the variance (from the norm and the mean), so equal tensors give equal figures.
    return TensorStats(v.numel(), mean, float(f.abs().max()), l2, max(l2 * l2 / n - mean * mean, 0.0), nan, inf)


def stats_measure(target: TensorStats, ref: TensorStats, dtype: str) -> Measure:
    """Lower bounds on the error between two tensors known only by their statistics (see the module docstring)."""
    if not aten.floating_dtype(dtype):
        # The figures are float64 sums of integers: equal tensors give equal figures up to the summation order of
        # whoever computed them (the recorder, or compare_refs for a full trace), so "equal" allows 1e-12.
        same = all(abs(getattr(target, f) - getattr(ref, f)) <= 1e-12 * max(1.0, abs(getattr(ref, f)))
                   for f in TensorStats.FIELDS)
        return ExactMismatch(0 if same else 1)
    finite = max(1, ref.numel - ref.nan - ref.inf)
    l2 = max(abs(target.l2 - ref.l2), abs(target.mean - ref.mean) * math.sqrt(finite),
             abs(math.sqrt(max(target.var, 0.0)) - math.sqrt(max(ref.var, 0.0))) * math.sqrt(finite))
    max_abs = abs(target.absmax - ref.absmax)
    eps = _eps(dtype) or 1.0
    rel = l2 / ref.l2 if ref.l2 > 0 else (0.0 if l2 == 0 else math.inf)
    norm_max = max_abs / (eps * ref.absmax) if ref.absmax > 0 else (0.0 if max_abs == 0 else math.inf)
    fe = FloatError(max_abs, rel, norm_max, rel / eps, math.nan, target.nan + target.inf, ref.nan + ref.inf)
    bad = abs(target.nan - ref.nan) + abs(target.inf - ref.inf)
    return NonfiniteMismatch(bad, fe) if bad else fe


def coarser_dtype(target: str, ref: str) -> str:
    """The dtype whose limits apply to a pair of tensors: the coarser side's (its rounding explains the difference)."""
    return target if _eps(target) >= _eps(ref) else ref


def op_reduction_k(op: OpRecord) -> int:
    """The longest sum behind an op's outputs (replay's limit scaling), from its name and shapes."""
    return reduction_length(aten.packet(op.name), [list(r.shape) for r in iter_refs(op.args)],
                            max(1, max((math.prod(r.shape) for r in op.outputs_refs()), default=1)))


def compare_refs(ref_trace: RankTrace, r: TensorRef, target_trace: RankTrace, t: TensorRef,
                 floor: str | None = None) -> Compared | None:
    """Compare the tensor ``r`` of the reference with ``t`` of the target; None when neither has anything to show.
    ``floor``: a coarser dtype than either side's whose limits apply (see ``PairComparer._at_floor``)."""
    if r.uninitialised or t.uninitialised:
        return None
    coarse = coarser_dtype(t.dtype, r.dtype)
    if floor is not None:
        coarse = coarser_dtype(floor, coarse)
    if tuple(r.shape) != tuple(t.shape):
        return Compared(Evidence.SHAPES, ShapeMismatch(list(t.shape), list(r.shape)), coarse)
    if r.stored and t.stored and not r.meta and not t.meta:
        a = target_trace.tensor(t)
        b = ref_trace.tensor(r)
        if a.dtype == b.dtype and torch.equal(a, b):  # the common case when two runs agree: one cheap call
            m: Measure = ExactMismatch(0) if not aten.floating_dtype(t.dtype) else FloatError(0.0, 0.0, 0.0, 0.0, 1.0)
            return Compared(Evidence.FULL, m, coarse)
        if coarse == r.dtype and r.dtype != t.dtype:
            return Compared(Evidence.FULL, measure(b, a), coarse)  # the coarser side plays "recorded"
        return Compared(Evidence.FULL, measure(a, b), coarse)
    rs, ts = r.stats, t.stats
    # A full trace against a stats trace: the full side's statistics are computed here, so the pair is still judged.
    if rs is None and ts is not None and r.stored and not r.meta:
        rs = tensor_stats(ref_trace.tensor(r))
    if ts is None and rs is not None and t.stored and not t.meta:
        ts = tensor_stats(target_trace.tensor(t))
    if rs is not None and ts is not None:
        return Compared(Evidence.STATS, stats_measure(ts, rs, coarse), coarse)
    return Compared(Evidence.SHAPES, None, coarse)


class Judge:
    """Turns a measure into a verdict: the fixed per-dtype limits, or per-op limits from a baseline's noise."""

    def __init__(self, tolerances: Tolerances, noise: dict[Where, Measure] | None = None,
                 safety: float = 8.0) -> None:
        self.tolerances = tolerances
        self.noise = noise
        self.safety = safety

    def __call__(self, m: Measure, dtype: str, k: int, where: Where) -> Verdict:
        noise = None if self.noise is None else self.noise.get(where)
        if noise is None:
            return judge_measure(m, dtype, self.tolerances, k)
        if isinstance(noise, NonfiniteMismatch) or isinstance(noise, ShapeMismatch) or \
                (isinstance(noise, ExactMismatch) and noise.mismatches):
            # The two reference runs already differ this way here: nothing the target does is judged against it.
            return Verdict(False, m, None)
        if isinstance(noise, FloatError) and isinstance(m, FloatError):
            # The baseline only widens the fixed limits: two reference runs equal bit for bit (no noise) say
            # nothing about how much a correct run may differ, and a last-bit difference is not a divergence.
            fixed_max, fixed_rel = self.tolerances.limit_for(dtype, k)
            limits = (max(fixed_max, self.safety * noise.norm_max), max(fixed_rel, self.safety * noise.norm_rel))
            tol = Tolerances(limits={dtype: limits}, scale_reductions=False)
            return judge_measure(m, dtype, tol, k)
        return judge_measure(m, dtype, self.tolerances, k)


def _plain_args(op: OpRecord) -> list:
    """The non-tensor arguments (scalars, dtypes, lists of ints...), in order, tensors left out."""
    out: list = []

    def walk(v: Any) -> None:
        if isinstance(v, TensorRef):
            return
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, Opaque):
            out.append(v.kind)
        elif isinstance(v, torch.dtype):
            out.append("dtype")  # autocast casts to another dtype on one side: not a change of the computation
        elif isinstance(v, torch.device):
            out.append(v.type)
        else:
            out.append(v)

    walk(op.args)
    for k in sorted(op.kwargs):
        out.append(k)
        walk(op.kwargs[k])
    return out


class PairComparer:
    """Compares aligned op pairs of one rank pair, in op order, remembering tensor comparisons already made (an
    op's input is usually an earlier op's output, judged there)."""

    def __init__(self, ref: RankTrace, target: RankTrace, judge: Judge,
                 cast_from: tuple[dict[tuple, TensorRef], dict[tuple, TensorRef]] = ({}, {}),
                 coarsest: str | None = None) -> None:
        self.ref = ref
        # Two runs at different precisions (autocast on one side): the coarser dtype they compute at. Then a plain
        # number argument that agrees within that dtype's rounding agrees (a mask's finfo(dtype).min), and an op
        # with no tensor input whose plain arguments agree starts from the same values.
        self.coarsest = coarsest
        self.target = target
        self.judge = judge
        # Per side, tensors made by casting on one side only (autocast's casts, engine._upcasts), by geometry: such a
        # tensor is compared as the one it was cast from.
        self.cast_from = cast_from
        self._seen: dict[tuple, tuple[Compared | None, Verdict | None]] = {}
        self._replayers: tuple[OpReplayer, OpReplayer] | None = None

    def tensor_verdict(self, r: TensorRef, t: TensorRef, k: int, where: Where) -> tuple[Compared | None,
                                                                                         Verdict | None]:
        src_r, src_t = self.cast_from[0].get(r.geometry), self.cast_from[1].get(t.geometry)
        if (src_r is not None or src_t is not None) and tuple((src_r or r).shape) == tuple((src_t or t).shape):
            return self.tensor_verdict(src_r or r, src_t or t, k, where)
        key = (r.geometry, t.geometry)
        hit = self._seen.get(key)
        if hit is not None:
            return hit
        c = compare_refs(self.ref, r, self.target, t)
        v = None if c is None or c.measure is None else self.judge(c.measure, c.dtype, k, where)
        self._seen[key] = (c, v)
        return c, v

    def compare(self, rop: OpRecord, top: OpRecord, origin_of: Callable[[int, int], Origin],
                carries_step_inputs: bool = False) -> PairResult:
        """Judge one aligned pair; ``origin_of(target op, input position)`` says where a differing input came
        from; ``carries_step_inputs``: the target op's inputs descend from a step input that already differed."""
        ins = self._inputs(rop, top)
        outs = self._outputs(rop, top, ins.floor)
        status, notes, inherited_from = _decide(ins, outs, carries_step_inputs,
                                                lambda pos: origin_of(top.index, pos))
        verdict, explained = outs.verdict, False
        if status is PairStatus.DIVERGENT and ins.agree and outs.evidence and \
                all(e is Evidence.FULL for e in outs.evidence):
            replayed = self._replayed(rop, top)
            if replayed is not None and all(r.status is Status.OK for r in replayed):
                status, notes, explained = PairStatus.SAME, (RightGivenOwnInputs(ins.exact),), True
                verdict = replace(verdict, divergent=False, reason=None) if verdict is not None else None
                self._agree(rop, top)
            elif replayed is not None:
                wrong = [(side, r) for side, r in zip(("ref", "target"), replayed) if r.status is Status.DIVERGENT]
                if wrong:
                    said = next((r.reason for _, r in wrong if r.reason), "over its limits")
                    notes = notes[:-1] + (WrongGivenOwnInputs("both" if len(wrong) == 2 else wrong[0][0], said),
                                          notes[-1])
        elif status is PairStatus.INHERITED and self._precision_only(inherited_from) and outs.evidence and \
                all(e is Evidence.FULL for e in outs.evidence):
            # Two runs at different precisions, and the differing input came from an op the target runs alone (an
            # extra accumulation in the coarser dtype) that is right given its own inputs: no difference entered
            # there, and none enters here when each side's op is right given its own inputs.
            replayed = self._replayed(rop, top)
            if replayed is not None and all(r.status is Status.OK for r in replayed):
                status, notes, explained = PairStatus.SAME, (RightGivenOwnInputs(False),), True
                verdict = replace(verdict, divergent=False, reason=None) if verdict is not None else None
                inherited_from = None
                self._agree(rop, top)
        return PairResult(ref=rop.index, target=top.index, op=rop.name, status=status, module=rop.module,
                          phase=rop.phase, source=rop.source, forward_index=rop.forward_index,
                          location=self.ref.location(rop),
                          target_op=top.name if top.name != rop.name else None, evidence=weakest(outs.evidence),
                          inputs_agree=ins.agree, verdict=verdict, reason=render(notes),
                          inherited_from=inherited_from, dtypes=outs.dtypes, explained=explained)

    def _precision_only(self, origin: Origin | None) -> bool:
        """Whether a difference from ``origin`` is the two precisions' own: the runs compute at different dtypes,
        and it is an op the target runs alone that is right given its own inputs."""
        if self.coarsest is None or origin is None or origin.kind is not OriginKind.TARGET_ONLY or \
                origin.target is None:
            return False
        try:
            return self.right_given_own_inputs("target", self.target[origin.target])
        except Exception:  # not replayable here: it may be where the difference entered
            return False

    def _replayed(self, rop: OpRecord, top: OpRecord) -> tuple[OpResult, OpResult] | None:
        """Each side's op replayed alone from its own recorded inputs, as ``replay`` does (CPU, float64, the diff's
        limits, an ill-conditioned op judged against its own error at its dtype); None when either cannot be."""
        results = (self.replayed("ref", rop), self.replayed("target", top))
        if any(r.status not in (Status.OK, Status.DIVERGENT) for r in results):  # skipped, error: not judged
            return None
        return results

    def replayed(self, side: str, op: OpRecord) -> OpResult:
        """One op of one side ("ref" or "target") replayed alone from its own recorded inputs (a compiled unit: its
        graph interpreted, as replay does)."""
        if self._replayers is None:
            opts = ReplayOptions(device="cpu", precision="fp64", tolerances=self.judge.tolerances)
            self._replayers = (OpReplayer(self.ref, opts), OpReplayer(self.target, opts))
        return self._replayers[0 if side == "ref" else 1].replay(op)

    def right_given_own_inputs(self, side: str, op: OpRecord) -> bool:
        """Whether ``op`` of ``side``, replayed alone from its own inputs, is right (not skipped, not divergent)."""
        return self.replayed(side, op).status is Status.OK

    def _agree(self, rop: OpRecord, top: OpRecord) -> None:
        """The pair's outputs count as agreeing from here on: the ops reading them start from values that differ
        only as two right ops' results may."""
        for r, t in zip(rop.outputs_refs(), top.outputs_refs()):
            key = (r.geometry, t.geometry)
            c, v = self._seen.get(key, (None, None))
            if v is not None and v.divergent:
                self._seen[key] = (c, replace(v, divergent=False, reason=None))

    def _at_floor(self, r: TensorRef, t: TensorRef, c: Compared, v: Verdict | None, floor: str | None, k: int,
                  where: Where) -> tuple[Compared, Verdict | None]:
        """An output compared by its statistics, of two runs at different precisions, whose op read an input that
        differs within a coarser dtype's rounding (a float32 LayerNorm statistic of a bfloat16 activation under
        autocast): it is judged at that coarser dtype, and so are the ops reading it. With whole tensors no such
        allowance is made: each side's op is replayed from its own inputs instead, which a statistic cannot be."""
        if self.coarsest is None or floor is None or c.evidence is not Evidence.STATS or c.measure is None or \
                coarser_dtype(floor, c.dtype) == c.dtype:
            return c, v
        c = compare_refs(self.ref, r, self.target, t, floor=floor) or c
        v = None if c.measure is None else self.judge(c.measure, c.dtype, k, where)
        self._seen[(r.geometry, t.geometry)] = (c, v)
        return c, v

    def _inputs(self, rop: OpRecord, top: OpRecord) -> "_InputsSeen":
        """Do the two ops start from the same values (tensors first, then plain arguments and generator state)?"""
        ins_r, ins_t = rop.inputs(), top.inputs()
        agree: bool | None = None
        exact = True  # every compared input equal bit for bit (else: within tolerance only)
        by_stats = False
        first_bad: int | None = None
        floor: str | None = None  # the coarsest dtype an input that differs was judged at
        for pos, (r, t) in enumerate(zip(ins_r, ins_t)):
            c, v = self.tensor_verdict(r, t, 1, (rop.index, "in", pos))
            if c is None or v is None:
                continue
            if v.divergent:
                agree, first_bad = False, pos
                break
            agree = True
            same = c.evidence is Evidence.FULL and _is_zero(v.measure)
            exact = exact and same
            by_stats = by_stats or c.evidence is Evidence.STATS
            if not same and aten.floating_dtype(c.dtype):
                floor = c.dtype if floor is None else coarser_dtype(c.dtype, floor)
        args_differ: Note | None = None
        if len(ins_r) != len(ins_t):
            agree = False
            args_differ = TensorInputCount(len(ins_r), len(ins_t))
        elif agree is not False:
            pa, pt = _plain_args(rop), _plain_args(top)
            if pa != pt and not (self.coarsest is not None and _within_rounding(pa, pt, _eps(self.coarsest))):
                args_differ = PlainArgsDiffer(_first_difference(pa, pt))
            elif pa != pt:  # numbers that differ by the coarser dtype's rounding (a mask's finfo(dtype).min)
                floor = self.coarsest
                if agree is None and not ins_r:
                    agree = True  # no tensor input: the same start, but for that rounding
            elif agree is None and not ins_r and self.coarsest is not None:
                agree = True  # no tensor input, the same arguments: the same start
        if args_differ is None and agree is not False and rop.rng is not None and top.rng is not None:
            if not torch.equal(self.ref.rng_state(rop.rng), self.target.rng_state(top.rng)):
                args_differ = DiffFact.OTHER_GENERATOR_STATE
        return _InputsSeen(agree, exact, by_stats, first_bad, args_differ, floor)

    def _outputs(self, rop: OpRecord, top: OpRecord, floor: str | None = None) -> "_OutputsSeen":
        """The outputs judged, with the evidence each comparison had. ``floor``: the coarsest dtype a differing input
        was judged at (see ``_at_floor``)."""
        outs_r, outs_t = rop.outputs_refs(), top.outputs_refs()
        k = op_reduction_k(rop)
        judged: list[Verdict] = []
        names: list[OutputName] | None = None  # which result each is, for an op with several
        evidence: list[Evidence] = []
        dtypes = None
        for pos, (r, t) in enumerate(zip(outs_r, outs_t)):
            c, v = self.tensor_verdict(r, t, k, (rop.index, "out", pos))
            if c is None:
                continue
            c, v = self._at_floor(r, t, c, v, floor, k, (rop.index, "out", pos))
            evidence.append(c.evidence)
            if r.dtype != t.dtype and dtypes is None:
                dtypes = (r.dtype, t.dtype)
            if v is not None:
                if names is None and len(outs_r) > 1:
                    names = output_names(rop)
                judged.append(replace(v, output=names[pos]) if names is not None and pos < len(names) else v)
        return _OutputsSeen(tuple(judged), tuple(evidence), dtypes)


@dataclass(frozen=True)
class _InputsSeen:
    """What comparing a pair's inputs found."""

    tensors_agree: bool | None  # None: no tensor input could be compared
    exact: bool  # every compared input equal bit for bit
    by_stats: bool  # some input compared by its statistics only
    first_bad: int | None  # the first tensor input beyond tolerance
    args_differ: Note | None  # the plain arguments, the number of inputs or the generator state differ
    floor: str | None = None  # the coarsest dtype a differing input was judged at

    @property
    def agree(self) -> bool | None:
        return False if self.args_differ else self.tensors_agree


@dataclass(frozen=True)
class _OutputsSeen:
    judged: tuple[Verdict, ...]
    evidence: tuple[Evidence, ...]
    dtypes: tuple[str, str] | None  # (ref, target) output dtypes, when they differ

    @property
    def bad(self) -> list[Verdict]:
        return [v for v in self.judged if v.divergent]

    @property
    def verdict(self) -> Verdict | None:
        """The deciding output: the first divergent one, else the worst."""
        bad = self.bad
        return bad[0] if bad else max(self.judged, key=lambda v: v.severity) if self.judged else None


def _decide(ins: _InputsSeen, outs: _OutputsSeen, carries_step_inputs: bool,
            origin_of: Callable[[int], Origin]) -> tuple[PairStatus, tuple[Note, ...], Origin | None]:
    """The pair's status, notes and (inherited) where its difference came from."""
    if not outs.judged:
        fact = DiffFact.NO_OUTPUT_DATA if outs.evidence else DiffFact.NO_OUTPUT
        return PairStatus.NOT_COMPARED, (fact,) + ((ins.args_differ,) if ins.args_differ else ()), None
    bad = outs.bad
    if not bad:
        return PairStatus.SAME, (), None
    said = verdict_reason(bad[0].reason)
    if ins.agree is False and not ins.args_differ:
        if ins.first_bad is not None:
            return PairStatus.INHERITED, said + (InputDiffered(ins.first_bad),), origin_of(ins.first_bad)
        return PairStatus.INHERITED, said + (DiffFact.INPUTS_DIFFERED,), None
    if carries_step_inputs and not ins.args_differ and not (ins.agree and ins.exact):
        return PairStatus.INHERITED, said + (CarriedFromStep(ins.agree),), Origin(OriginKind.OUTSIDE)
    # Inputs equal bit for bit make the op itself the cause; inputs that agree only within tolerance leave room for
    # an ill-conditioned op amplifying a small earlier difference (--baseline settles which).
    why = ins.args_differ or ((DiffFact.INPUTS_AGREE_IN_STATISTICS if ins.by_stats else DiffFact.INPUTS_EQUAL
                               if ins.exact else DiffFact.INPUTS_WITHIN_TOLERANCE) if ins.agree else
                              DiffFact.NO_INPUT_COMPARED if ins.agree is None else DiffFact.OUTPUTS_DIFFER)
    return PairStatus.DIVERGENT, said + (why,), None


def _is_zero(m: Measure) -> bool:
    return (isinstance(m, FloatError) and m.max_abs == 0 and m.nonfinite_recorded == m.nonfinite_reference) or \
        (isinstance(m, ExactMismatch) and m.mismatches == 0)


def _within_rounding(a: list, b: list, eps: float) -> bool:
    """Plain arguments equal but for floats that differ by at most one rounding at ``eps``'s precision."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        if not (isinstance(x, float) and isinstance(y, float)) or not (math.isfinite(x) and math.isfinite(y)):
            return False
        if abs(x - y) > eps * max(abs(x), abs(y)):
            return False
    return True


def _first_difference(a: list, b: list) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"{x!r} against {y!r}"
    return f"{len(a)} against {len(b)} values"
