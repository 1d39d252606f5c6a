"""Diffing two traces: pair their ranks, align each pair's op streams, compare the aligned pairs, diff environments.

Ranks pair up by number; a single-process trace (one rank, world size 1) pairs with every rank of the other (rank 0
of 8 against a single process, or each rank of a 2-rank run against it), while a trace of some ranks of a larger job
(``record --ranks 1``) keeps pairing by number. ``--rank`` keeps one.
With a baseline (a second reference run), the reference is first diffed against the baseline: the error of each
tensor between the two reference runs, times a safety factor, widens that tensor's limit beyond the fixed per-dtype
limits (never narrows them: no error between the two reference runs leaves the fixed limits).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import torch

from replaydiff.trace.schema import dtype_from_name
from replaydiff import aten

from replaydiff.compare.metrics import Measure
from replaydiff.compare.tolerance import Tolerances
from replaydiff.diff.align import Alignment, OpKeys, align, op_keys
from replaydiff.diff.pairs import Judge, PairComparer, Where, coarser_dtype, compare_refs
from replaydiff.diff.environment import environment_diff
from replaydiff.diff.parallel import (diff_parallel, diff_parallel_groups, is_parallel_groups, is_parallel_pair,
                                      only_steps, same_program, steps_of)
from replaydiff.diff.units import pair_units
from replaydiff.diff.result import (DiffReport, OpPlace, Origin, OriginKind, PairResult, PairStatus, Precision,
                                    RankDiff, StepInput, StepInputs, Unaligned)
from replaydiff.errors import UsageError
from replaydiff.trace.modes import TensorMode
from replaydiff.trace.reader import RankTrace, Trace, open_trace
from replaydiff.trace.schema import OpRecord, TensorRef

DEFAULT_SAFETY = 8.0


@dataclass
class DiffOptions:
    rank: int | None = None  # only this rank of the multi-rank side (the target's unless it is a single process)
    tolerances: Tolerances = field(default_factory=Tolerances)
    safety: float = DEFAULT_SAFETY  # baseline mode: limit = safety x the two reference runs' own difference
    step: int | None = None  # only this step of a trace recorded with step numbers (--steps, --step N)

    def __post_init__(self) -> None:  # refused from Python as from the CLI, which says it as a usage error
        if not self.safety > 0:
            raise ValueError(f"--safety must be positive, not {self.safety!r}")

    def to_dict(self) -> dict:
        return {"rank": self.rank, "tolerances": {k: list(v) for k, v in self.tolerances.limits.items()},
                "scale_reductions": self.tolerances.scale_reductions, "safety": self.safety, "step": self.step}


def rank_pairs(ref: list[int], target: list[int], only: int | None = None, ref_world: int = 1,
               target_world: int = 1) -> list[tuple[int, int]]:
    """(reference rank, target rank) pairs to diff, given the ranks each trace holds and the world size of the job
    that recorded it. A trace is a single process when it holds one rank of a job of world size 1 (a trace that
    does not know its world size counts as one): it pairs with every rank of the other. Otherwise ranks pair by
    number: a ``record --ranks 1`` trace of a 2-rank job holds rank 1 of 2, and pairs with rank 1 alone."""
    ref_single = len(ref) == 1 and ref_world <= 1
    target_single = len(target) == 1 and target_world <= 1
    if ref_single:
        pairs = [(ref[0], t) for t in target]
    elif target_single:
        pairs = [(r, target[0]) for r in ref]
    else:
        pairs = [(r, r) for r in target if r in ref]
    if not pairs:
        raise UsageError(f"the traces share no rank (reference ranks {ref}, target ranks {target})")
    if only is not None:
        # N names a rank of the multi-rank side: the target's, or the reference's against a single-process target.
        side, ranks = (0, ref) if target_single and not ref_single else (1, target)
        kept = [p for p in pairs if p[side] == only]
        if not kept:
            which = "reference" if side == 0 else "target"
            if not (ref_single or target_single) and (only in ref or only in target):  # paired by number
                raise UsageError(f"rank {only} is not in both traces (reference ranks {ref}, target ranks {target})")
            raise UsageError(f"rank {only} is not in the {which} trace (ranks: {ranks})")
        pairs = kept
    return pairs


class _Ops:
    """One rank's recorded ops and their alignment keys, read once."""

    def __init__(self, trace: RankTrace, read: bool = True) -> None:
        self.trace = trace
        self.ops: dict[int, OpRecord] = {}
        self.keys: list[OpKeys] = []
        self.inputs: dict[int, list[TensorRef]] = {}  # each op's input tensors (read by several passes)
        if not read:
            return
        for op in trace:
            self.ops[op.index] = op
            self.keys.append(op_keys(op))
            self.inputs[op.index] = op.inputs()

    @cached_property
    def steps(self) -> list[int]:
        """The step numbers its ops carry (none for a trace recorded without steps, from Python's record())."""
        return sorted({op.step for op in self.ops.values() if op.step is not None})

    def only(self, steps: set[int]) -> "_Ops":
        """The ops of these steps alone: what an op of another step computed is then from outside the trace."""
        out = _Ops(self.trace, read=False)
        out.ops = {i: op for i, op in self.ops.items() if op.step in steps}
        out.keys = [k for k in self.keys if k.index in out.ops]
        out.inputs = {i: self.inputs[i] for i in out.ops}
        return out


def steps_text(steps: list[int]) -> str:
    """'steps 1-5', 'step 3', 'steps 1, 3, 7', or 'one step without a step number' (no steps)."""
    if not steps:
        return "one step without a step number"
    if len(steps) == 1:
        return f"step {steps[0]}"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}-{steps[-1]}"
    return "steps " + ", ".join(map(str, steps))


def pick_steps(ref: list[int], target: list[int], step: int | None) -> tuple[list[int] | None, str | None]:
    """The steps to compare of two traces holding steps ``ref`` and ``target`` (empty: one step without a number),
    and the line that says so when the traces hold different steps (or ``--step`` picks one). None: all of them.
    A usage error when nothing like can be compared with like."""
    held = f"the reference holds {steps_text(ref)}, the target {steps_text(target)}"
    if step is not None:
        missing = [side for side, s in (("reference", ref), ("target", target)) if s and step not in s]
        if missing or not (ref or target):
            why = f"step {step} is not in the {' or '.join(missing)} trace" if missing else \
                "neither trace has step numbers (recorded with --step N or --steps)"
            raise UsageError(f"{why}: {held}")
        return [step], f"comparing step {step} ({held})"
    if ref == target:
        return None, None
    if not ref or not target:
        many = target if not ref else ref
        if len(many) == 1:
            return None, f"comparing {steps_text(many)} with the other trace's one step ({held})"
        raise UsageError(f"{held}: pick the step to compare with --step N")
    common = sorted(set(ref) & set(target))
    if not common:
        raise UsageError(f"the traces share no step ({held})")
    if len(common) == 1:
        return common, f"comparing {steps_text(common)}, the only step both hold ({held})"
    return common, f"comparing {steps_text(common)}, the steps both hold ({held})"


def _runs(side: str, indices: list[int], ops: dict[int, OpRecord]) -> list[Unaligned]:
    """Group unaligned op numbers into runs of consecutive ops in one module and phase."""
    runs: list[Unaligned] = []
    cur: list[int] = []

    def flush() -> None:
        if cur:
            first = ops[cur[0]]
            runs.append(Unaligned(side, tuple(cur), tuple(ops[i].name for i in cur), first.module, first.phase))
            cur.clear()

    prev = None
    for i in indices:
        op = ops[i]
        if prev is not None and (i != prev + 1 or (op.module, op.phase) != (ops[prev].module, ops[prev].phase)):
            flush()
        cur.append(i)
        prev = i
    flush()
    return runs


def _noise(ref: _Ops, base: _Ops) -> dict[Where, Measure]:
    """The difference between two reference runs, per tensor of the reference (baseline mode)."""
    noise: dict[Where, Measure] = {}
    al = align(ref.keys, base.keys)
    for i, j in al.pairs:
        a, b = ref.ops[i], base.ops[j]
        for kind, ra, rb in (("in", a.inputs(), b.inputs()), ("out", a.outputs_refs(), b.outputs_refs())):
            for pos, (x, y) in enumerate(zip(ra, rb)):
                c = compare_refs(ref.trace, x, base.trace, y)
                if c is not None and c.measure is not None:
                    noise[(i, kind, pos)] = c.measure
    return noise


def _collective_behind(start: int, side: _Ops, unaligned: set[int], limit: int = 64) -> tuple[int, str] | None:
    """The nearest collective reached from ``start`` walking back through producers that are unaligned ops."""
    seen, todo = {start}, [start]
    while todo and len(seen) <= limit:
        i = todo.pop(0)
        op = side.ops.get(i)
        if op is None:
            continue
        if aten.is_collective(op.name):
            return i, op.name
        for p in side.trace.producers(i).values():
            if p is not None and p in unaligned and p not in seen:
                seen.add(p)
                todo.append(p)
    return None


def _outside(side: _Ops, index: int, pos: int, version: int | None) -> bool:
    """Input ``pos`` of op ``index`` holds values no op of the trace computed: it has no producer, or only views of
    a tensor that has none (the index names the first op to return a view of a storage as that storage's producer,
    so a weight read after ``aten.t`` of it has the ``t`` as its producer)."""
    p = side.trace.producers(index).get(pos)
    for _ in range(64):  # views of views; a longer chain is taken as computed
        if p is None or p not in side.inputs:  # no producer, or one in a step left out of the diff
            return True
        ins = side.inputs.get(p)
        k = None if ins is None or version is None else \
            next((q for q, r in enumerate(ins) if r.version == version), None)
        if k is None:  # the producer computed these bytes (or wrote them in place: that makes a new version)
            return False
        p = side.trace.producers(p).get(k)
    return False


def _step_inputs(ref: _Ops, target: _Ops, pairs: list[tuple[int, int]],
                 comparer: PairComparer) -> tuple[StepInputs, set[int]]:
    """The step's inputs (read by an aligned pair, computed by no op on either side) judged between the runs, those
    beyond tolerance ordered by what matters (below), and the target's storage versions of those."""
    first_read: dict[int, OpPlace] = {}
    for op in ref.ops.values():
        for r in ref.inputs[op.index]:
            if r.version is not None and r.version not in first_read:
                first_read[r.version] = OpPlace(op.index, op.name, op.module, op.phase)
    out = StepInputs(first_step=min((op.step for op in ref.ops.values() if op.step is not None), default=None))
    versions: set[int] = set()
    seen: set[tuple] = set()
    for i, j in pairs:
        rop = ref.ops[i]
        for pos, (r, t) in enumerate(zip(ref.inputs[i], target.inputs[j])):
            # One tensor per storage on each side: a weight and the transposed view of it that a matmul reads.
            key = (r.version if r.version is not None else r.geometry, t.version if t.version is not None else
                   t.geometry)
            if key in seen or not _outside(ref, i, pos, r.version) or not _outside(target, j, pos, t.version):
                continue
            seen.add(key)
            _, v = comparer.tensor_verdict(r, t, 1, (i, "in", pos))
            if v is None:
                continue
            out.compared += 1
            if v.divergent:
                read = first_read.get(r.version) or OpPlace(i, rop.name, rop.module, rop.phase)
                out.differing.append(StepInput(read, i, j, rop.name, pos, rop.module, rop.phase, t.describe(),
                                               t.requires_grad, v, ref.ops[read.index].step))
                if t.version is not None:
                    versions.add(t.version)
    # "first" is the one that matters: an input some computation reads before a value only handed to Python (the
    # previous step's loss.item() in a print, which no op of the step depends on); then in the order the reference
    # reads them, so that it is the input behind the first pair that differs (the forward's reads come first).
    out.differing.sort(key=lambda d: (aten.reads_to_python(d.read_first.op), d.read_first.index, d.ref))
    return out, versions


def _carriers(side: _Ops, versions: set[int]) -> set[int]:
    """The ops of one side whose inputs descend, through the ops of the trace, from a step input whose storage
    version is in ``versions`` (an op that writes such a tensor in place carries it on, as its output does)."""
    out: set[int] = set()
    if not versions:
        return out
    for j, ins in side.inputs.items():  # in op order
        producers = side.trace.producers(j)
        for pos, t in enumerate(ins):
            p = producers.get(pos)
            if (p in out) if p is not None and p in side.inputs else (t.version in versions):
                out.add(j)
                break
    return out


def _coarsest(casts: tuple[dict[tuple, TensorRef], ...]) -> str | None:
    """The coarsest dtype one side casts to or from on its own (autocast): the two runs compute at different
    precisions, and that dtype's rounding is what they may differ by. None: no such cast."""
    dtypes = {geometry[1] for side in casts for geometry in side} | {t.dtype for side in casts for t in side.values()}
    found = None
    for d in dtypes:
        found = d if found is None else coarser_dtype(d, found)
    return found


def _floating(dtype: str) -> bool:
    try:
        return dtype_from_name(dtype).is_floating_point
    except Exception:
        return False


def _upcasts(side: _Ops, only: set[int]) -> dict[tuple, TensorRef]:
    """The tensors that ops on one side only made by casting a floating tensor to another floating dtype (autocast's
    casts down to bfloat16 before a matmul, and back up to float32 before a log_softmax or in the backward):
    {the cast's output (its geometry): the tensor it was cast from}. Such a tensor is compared as the one it was
    cast from: a cast up is exact, and a cast down is the rounding the coarser dtype's limits allow for, which the
    ops reading it are judged at. An autocast cast is thus never where differences enter: they enter (or not) where
    the tensor it casts was made. A cast whose recorded output is not its input cast (a faulty kernel) is left out:
    a difference then enters there."""
    out: dict[tuple, TensorRef] = {}
    for i in sorted(only):
        op = side.ops.get(i)
        if op is None or aten.packet(op.name) != "_to_copy":
            continue
        ins, outs = side.inputs[i], op.outputs_refs()
        if len(ins) == 1 and len(outs) == 1 and outs[0].version is not None and ins[0].dtype != outs[0].dtype and \
                _floating(ins[0].dtype) and _floating(outs[0].dtype) and _cast_right(side.trace, ins[0], outs[0]):
            # keyed by the cast's output itself (a view of it, a transpose, is another tensor)
            out[outs[0].geometry] = out.get(ins[0].geometry, ins[0])
    return out


def _cast_right(trace: Any, src: TensorRef, dst: TensorRef) -> bool:
    """Whether the recorded output of a cast is its recorded input cast (bit for bit); True where the trace holds
    no data to tell (statistics, shapes)."""
    if not (src.stored_data and dst.stored_data):
        return True
    try:
        a, b = trace.tensor(src), trace.tensor(dst)
        cast = a.to(b.dtype)
        return cast.shape == b.shape and bool(((cast == b) | (cast.isnan() & b.isnan())).all())
    except Exception:  # unreadable here: not taken as a cast
        return False


def diff_ranks(ref: _Ops, target: _Ops, judge: Judge, alignment: Alignment | None = None,
               progress: Callable[[int], None] | None = None) -> RankDiff:
    al = alignment or align(ref.keys, target.keys)
    rd = RankDiff(ref.trace.rank, target.trace.rank, ref_ops=len(ref.keys), target_ops=len(target.keys))
    casts = (_upcasts(ref, set(al.ref_only)), _upcasts(target, set(al.target_only)))
    comparer = PairComparer(ref.trace, target.trace, judge, casts, _coarsest(casts))
    # Compiled units left unaligned against the eager ops of their region on the other side (one side compiled)
    rd.units, in_units = pair_units(ref.trace, ref.ops, target.trace, target.ops, al, comparer)
    rd.ref_only = _runs("ref", [i for i in al.ref_only if ("ref", i) not in in_units], ref.ops)
    rd.target_only = _runs("target", [j for j in al.target_only if ("target", j) not in in_units], target.ops)
    target_only = {j for j in al.target_only if ("target", j) not in in_units}
    producers_of = target.trace.producers

    def origin_of(target_index: int, pos: int) -> Origin:
        p = producers_of(target_index).get(pos)
        if p is None:
            return Origin(OriginKind.OUTSIDE)
        pair = rd.by_target.get(p)
        if pair is not None:
            return Origin(OriginKind.PAIR, pair.ref, pair.target)
        unit = in_units.get(("target", p))
        if unit is not None:
            return Origin(OriginKind.UNIT, unit.ref, unit.target, op=unit.op)
        if p in target_only:
            return Origin(OriginKind.TARGET_ONLY, target=p, op=target.ops[p].name,
                          collective=_collective_behind(p, target, target_only))
        return Origin(OriginKind.OUTSIDE)

    # The step's inputs first: when they already differ, an op downstream of them whose own inputs agree only
    # within tolerance carries that difference on (an ill-conditioned op amplifies it); it did not introduce one.
    rd.step_inputs, differing = _step_inputs(ref, target, al.pairs, comparer)
    carriers = _carriers(target, differing)
    for n, (i, j) in enumerate(al.pairs):
        p = comparer.compare(ref.ops[i], target.ops[j], origin_of, carries_step_inputs=j in carriers)
        rd.add(p)
        if progress is not None and n % 64 == 63:
            progress(64)
    rd.precision = _precision(rd.pairs, judge.tolerances)
    return rd


def _precision(pairs: list[PairResult], tolerances: Tolerances) -> list[Precision]:
    """The pairs computed at different dtypes, per (ref, target) dtype pair, most first, with the limits applied."""
    counts: dict[tuple[str, str], int] = {}
    for p in pairs:
        if p.dtypes is not None:
            counts[p.dtypes] = counts.get(p.dtypes, 0) + 1
    out = []
    for (a, b), n in sorted(counts.items(), key=lambda x: -x[1]):
        coarse = coarser_dtype(b, a)
        out.append(Precision(a, b, coarse, n, *tolerances.limit_for(coarse, 1)))
    return out


def diff_traces(ref: str | Path | Trace, target: str | Path | Trace, options: DiffOptions | None = None,
                baseline: str | Path | Trace | None = None,
                progress_total: Callable[[int], None] | None = None,
                progress: Callable[[int], None] | None = None) -> DiffReport:
    """Diff ``target`` against ``ref`` (paths or opened traces); see the module docstring."""
    # One intra-op thread: the tensors are small and many, and a thread pool on a busy machine costs 40x per call
    # (measured: 3.4 ms against 0.09 ms for an equality test and an fp64 copy of 64k floats on 2 loaded cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _diff_traces(ref, target, options, baseline, progress_total, progress)
    finally:
        torch.set_num_threads(threads)


def _need_data_for_layouts(rt: Trace, tt: Trace) -> None:
    """A parallel run is mapped onto the reference through its tensors' values (a shard is a slice, a partial value
    a term of a sum): statistics alone cannot be split or summed so, and a diff of such traces would compare nothing
    and agree whatever the runs did."""
    for t in (rt, tt):
        mode = t.rank(t.ranks[0]).options.tensors
        if mode is not None and not mode.stores_data:
            raise UsageError(f"{t.path} holds --tensors {mode.value} (no tensor data), and a parallel run is mapped "
                             f"onto the single process through its tensors' values: record both runs with --tensors "
                             f"full (--module/--op keep them small)")


def _world_size(t: Trace) -> int:
    """The world size of the job that recorded ``t`` (its manifests say; 1 when they do not)."""
    return max(r.world_size for r in t)


def _say_planted(report: DiffReport, rt: Trace, tt: Trace) -> None:
    for side, t in (("reference", rt), ("target", tt)):
        for r in t:
            if r.planted is not None:
                report.planted.append(f"in the {side} trace, {r.planted.describe()}")


def _diff_traces(ref: str | Path | Trace, target: str | Path | Trace, options: DiffOptions | None,
                 baseline: str | Path | Trace | None, progress_total: Callable[[int], None] | None,
                 progress: Callable[[int], None] | None) -> DiffReport:
    opts = options or DiffOptions()
    rt = ref if isinstance(ref, Trace) else open_trace(ref)
    tt = target if isinstance(target, Trace) else open_trace(target)
    bt = None if baseline is None else (baseline if isinstance(baseline, Trace) else open_trace(baseline))
    for t in (rt, tt) if bt is None else (rt, tt, bt):
        t.check_whole()  # ops gone from either trace would shift the alignment: name the file, exit 3
    rw, tw = _world_size(rt), _world_size(tt)
    grouped = opts.rank is None and bt is None and is_parallel_groups(rw, rt.ranks, tw, tt.ranks)
    if opts.rank is None and 1 < rw != tw > 1 and not grouped:
        # rank r of one layout holds other slices and shards than rank r of the other: pairing by number would
        # call every one of them a difference
        then = "put the run with fewer ranks first, as the reference" if tw < rw and rw % tw == 0 else \
            "diff each against a single-process run of the same script"
        raise UsageError(f"a {rw}-rank run against a {tw}-rank run is not mapped onto each other: only a reference "
                         f"whose world size divides the target's is; {then}, or compare one rank op by op with "
                         f"--rank N")
    if opts.rank is None and bt is None and is_parallel_pair(tw, tt.ranks, rw, rt.ranks) and \
            same_program(tt.rank(tt.ranks[0]), rt.rank(0)):
        # the single process second: rank by rank, rank 0 against it, every slice and shard a difference
        raise UsageError(f"a {rw}-rank run against a single process is not mapped with the parallel run first: put "
                         f"the single process (the run with fewer ranks) first, as the reference, or compare one rank "
                         f"op by op with --rank N")
    pairs = rank_pairs(rt.ranks, tt.ranks, opts.rank, rw, tw)
    report = DiffReport(ref=str(rt.path), target=str(tt.path), options=opts.to_dict(),
                        baseline=None if bt is None else str(bt.path))
    if opts.rank is None and not grouped:
        for t, used in ((rt, {a for a, _ in pairs}), (tt, {b for _, b in pairs})):
            left = [r for r in t.ranks if r not in used]
            if left:
                said = f"rank {left[0]} is" if len(left) == 1 else f"ranks {', '.join(map(str, left))} are"
                report.warnings.append(f"{said} only in {t.path}: not compared")
    first_ref, first_target = rt.rank(pairs[0][0]), tt.rank(pairs[0][1])
    report.environment = environment_diff(first_ref.environment, first_target.environment)
    # a side whose recording stopped part-way: said whichever way the traces are compared
    report.cut_short = [(side, c) for side, t in (("reference", rt), ("target", tt)) for c in t.cut_short]
    parallel = opts.rank is None and bt is None and \
        is_parallel_pair(_world_size(rt), rt.ranks, _world_size(tt), tt.ranks)
    chosen: list[int] | None = None
    if parallel or grouped:
        _need_data_for_layouts(rt, tt)
        # like with like, as rank by rank: the steps compared are those both traces hold, or --step N
        chosen, report.steps = pick_steps(steps_of(first_ref), steps_of(first_target), opts.step)
    if parallel:
        # every rank at once, mapped onto the single process through the layout of each value
        if progress_total is not None:
            progress_total(len(first_ref))
        report.parallel = diff_parallel(only_steps(first_ref, chosen),
                                        [only_steps(tt.rank(r), chosen) for r in tt.ranks], progress,
                                        cut_short=bool(report.cut_short))
        if report.parallel.batch_warning:
            report.warnings.append(report.parallel.batch_warning)
        _say_planted(report, rt, tt)
        return report
    if grouped:
        # each reference rank against the target's ranks that hold its share of the global batch
        if progress_total is not None:
            progress_total(sum(len(rt.rank(r)) for r in rt.ranks))
        report.parallel = diff_parallel_groups([only_steps(rt.rank(r), chosen) for r in rt.ranks],
                                               [only_steps(tt.rank(r), chosen) for r in tt.ranks],
                                               progress, cut_short=bool(report.cut_short))
        if report.parallel.batch_warning:
            report.warnings.append(report.parallel.batch_warning)
        _say_planted(report, rt, tt)
        return report
    _say_planted(report, rt, tt)
    for side, t in (("reference", rt), ("target", tt)):
        for r in t:
            if r.options.tensors is TensorMode.META:
                report.warnings.append(f"{side} rank {r.rank} was recorded with tensors=meta: only shapes can be "
                                       f"compared")
    cache: dict[tuple[str, int], _Ops] = {}

    def ops(side: str, t: Trace, rank: int) -> _Ops:
        key = (side, rank)
        if key not in cache:
            cache[key] = _Ops(t.rank(rank))
        return cache[key]

    # Like with like: which steps each trace holds decides which are compared (said first when they differ).
    chosen, report.steps = pick_steps(ops("ref", rt, pairs[0][0]).steps, ops("target", tt, pairs[0][1]).steps,
                                      opts.step)

    def of_steps(o: _Ops) -> _Ops:
        return o if chosen is None or not o.steps else o.only(set(chosen))

    if progress_total is not None:
        progress_total(sum(min(len(rt.rank(a)), len(tt.rank(b))) for a, b in pairs))
    for a, b in pairs:
        r_ops, t_ops = of_steps(ops("ref", rt, a)), of_steps(ops("target", tt, b))
        noise = None
        if bt is not None:
            base_rank = a if a in bt.ranks else bt.ranks[0]
            noise = _noise(r_ops, of_steps(ops("baseline", bt, base_rank)))
        judge = Judge(opts.tolerances, noise, opts.safety)
        report.ranks.append(diff_ranks(r_ops, t_ops, judge, progress=progress))
    return report
