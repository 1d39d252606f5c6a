"""Following the step's batch through a trace, op by op, and running each op that reads it on slices of it.

``BatchWalk`` takes the ops in recorded order and keeps, for each storage version that holds the batch, where its
rows are (``batch.Layout``). An op whose inputs hold the batch is run again through replay's own rebuilding of its
recorded inputs (``OpReplayer.recorded_call``), at its recorded dtypes on the recording backend, once per slice:
each batch-holding input is cut to the slice's rows (in a storage of its own, as a run on those rows alone holds
it), the others are passed whole. Each output whose batch dimension shrank with the slice is compared bit for bit
with the same rows of the recorded output; the dimension that shrank becomes its storage's layout for the ops that
read it. An op that could not be sliced leaves its outputs' batch unknown where it cannot be inferred, and ops that
read them are not judged rather than taken to have no batch.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from replaydiff import aten
from replaydiff.compare.metrics import ExactMismatch, FloatError, NonfiniteMismatch, measure
from replaydiff.errors import TraceError
from replaydiff.invariance.batch import BatchDim, Layout, is_step_input
from replaydiff.invariance.result import Finding, OpCheck, Rows, SliceDiff
from replaydiff.rebuild_and_judge import pick
from replaydiff.replay.compared import VALUES, VIEW, compared_outputs
from replaydiff.replay.runner import OpReplayer, Skip
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import OpRecord, TensorRef


class _Unclear(Exception):
    """A slice run whose outputs do not show where the batch went."""


class BatchWalk:
    """The state of one walk over the ops: the layout of each storage version that holds the batch."""

    def __init__(self, rt: RankTrace, replayer: OpReplayer, batch: int, rows: tuple[Rows, ...],
                 threads: int | None, batch_version: Any = None) -> None:
        self.rt = rt
        self.batch_version = batch_version  # the batch's storage version, where the step made it
        self.threads = threads
        self.replayer = replayer
        self.batch = batch
        self.rows = rows
        self.layouts: dict[Any, Layout] = {}
        self.produced: set = set()  # versions an op made
        self.constants: set = set()  # versions made by ops that read no batch (a mask built from sizes)
        self.unknown: dict[Any, int] = {}  # version -> the op that could not be sliced
        self.derived: set = set()  # versions made by ops that read the batch (and did not reduce it away)
        self.checks: list[OpCheck] = []

    def dim(self, ref: TensorRef) -> BatchDim | None:
        layout = self.layouts.get(ref.version)
        return None if layout is None else layout.dim_of(ref)

    # -- one op -------------------------------------------------------------------------------------------------
    def op(self, op: OpRecord) -> None:
        name = op.name
        if aten.is_marker(name):
            self.produced.update(r.version for r in op.outputs_refs())
            return
        if not op.recorded:  # numbered, with no record (a budget, a full disk): never taken as invariant
            self.checks.append(OpCheck(index=op.index, op=name, module=op.module, phase=op.phase, source=op.source,
                                       finding=Finding.NOT_JUDGED,
                                       reason=f"not recorded: {op.not_recorded_reason or 'no record'}"))
            return
        ins = op.inputs()
        self._seed(op, ins)
        batched = [(r, d) for r, d in ((r, self.dim(r)) for r in ins) if d is not None]
        lost = [self.unknown[r.version] for r in ins if r.version in self.unknown]
        finding, reason, diffs = Finding.NO_BATCH, None, ()
        if lost:
            finding, reason = Finding.NOT_JUDGED, f"reads a value whose batch dimension is unknown (op #{lost[0]} " \
                                                  f"could not be sliced)"
            self._inherit(op, batched, lost[0])
        elif not batched:
            self.constants.update(r.version for r in op.outputs_refs())
        else:
            finding, reason, diffs = self._judge(op, batched)
            if finding not in (Finding.REDUCES, Finding.MEAN):
                self.derived.update(r.version for r in op.outputs_refs())
        self.produced.update(r.version for r in op.outputs_refs())
        self.checks.append(OpCheck(index=op.index, op=name, module=op.module, phase=op.phase, source=op.source,
                                   finding=finding, reason=reason, diffs=diffs))

    def _seed(self, op: OpRecord, ins: list[TensorRef]) -> None:
        """The step's inputs of the forward (their first dimension the batch), and tensors of the batch's shape that
        no batch made, read beside one that holds the batch: an attention mask built from the batch size, the
        gradient of a mean (a constant expanded to the batch's shape) that the backward multiplies with."""
        forward = op.phase == "forward"
        if forward:
            for r in ins:
                if r.version not in self.layouts and (r.version == self.batch_version
                                                      or is_step_input(r, self.produced, self.batch)):
                    layout = BatchDim(0, 1).layout(r, self.batch)
                    if layout is not None:
                        self.layouts[r.version] = layout
        with_batch = [(r, d) for r, d in ((r, self.dim(r)) for r in ins) if d is not None and d.block == 1]
        for r in ins:
            if not with_batch or r.version in self.layouts or r.requires_grad or r.stride is None:
                continue
            if not (r.version in self.constants or (forward and r.version not in self.produced)):
                continue
            for other, d in with_batch:
                if len(r.shape) == len(other.shape) and r.shape[d.dim] == self.batch:
                    layout = d.layout(r, self.batch)
                    if layout is not None:
                        self.layouts[r.version] = layout
                    break

    def _inherit(self, op: OpRecord, batched: list[tuple[TensorRef, BatchDim]], culprit: int | None = None) -> None:
        """Outputs of an op that was not run: the batch where an input has it, the output having that input's
        dimensions up to the batch's (a same-shaped result, attention's log-sum-exp beside its output); else
        unknown."""
        for r in op.outputs_refs():
            if r.version in self.layouts or r.version in self.produced:
                continue
            same = next((d for i, d in batched if i.shape == r.shape or (
                d.block == 1 and len(r.shape) > d.dim and r.shape[:d.dim + 1] == i.shape[:d.dim + 1])), None)
            layout = None if same is None else same.layout(r, self.batch)
            if layout is not None:
                self.layouts[r.version] = layout
            else:
                self.unknown[r.version] = op.index if culprit is None else culprit

    def _judge(self, op: OpRecord, batched: list[tuple[TensorRef, BatchDim]]
               ) -> tuple[Finding, str | None, tuple[SliceDiff, ...]]:
        name = op.name
        why = None
        if aten.is_unit(name):
            why = "a compiled unit: its graph is not sliced"
        elif aten.is_collective(name):
            why = "a collective"
        elif op.uninitialised or not aten.reads_values(name):  # empty_like, ones_like: the shape alone
            self._inherit(op, batched)
            return Finding.VIEW, None, ()
        elif aten.is_random(name) and _draws(op):
            why = "a random op: a slice would draw other numbers"
        if why is not None:
            self._inherit(op, batched)
            return Finding.NOT_JUDGED, why, ()
        compared = compared_outputs(op, True)
        values = [c for c in compared if c.how == VALUES and isinstance(c.recorded, TensorRef)]
        if not values:
            if any(c.how == VIEW for c in compared):
                return Finding.VIEW, None, ()
            return Finding.REDUCES, None, ()
        try:
            outs = self._slices(op, values, batched)
        except Skip as exc:
            self._inherit(op, batched)
            return Finding.NOT_JUDGED, str(exc), ()
        except _Unclear as exc:
            self._inherit(op, batched)
            return Finding.NOT_JUDGED, str(exc), ()
        except TraceError:
            raise  # a damaged trace is exit 3, not one op's problem
        except Exception as exc:  # a kernel that refuses the slice: said, never taken as invariant
            try:  # once more, cutting too the inputs shaped as the batch beside one that holds it
                outs = self._slices(op, values, batched, loose=True)
            except TraceError:
                raise
            except Exception:
                self._inherit(op, batched)
                first = (str(exc).strip().splitlines() or [""])[0][:160]
                return Finding.NOT_JUDGED, f"the slice run failed: {type(exc).__name__}: {first}", ()
        kept, diffs = outs
        for c, d in kept:
            layout = d.layout(c.recorded, self.batch)
            if layout is not None:
                self.layouts.setdefault(c.recorded.version, layout)
        if not kept:
            return Finding.REDUCES, None, ()
        if any(d is not _SCALED for d in diffs) and not self._reproduces(op, values):
            return Finding.NOT_JUDGED, "the op run on the whole batch does not give its recorded bits either (a " \
                                       "non-deterministic kernel, or a recording that differs): `replaydiff replay " \
                                       "--precision same` judges it", ()
        far = [d for d in diffs if d is not _SCALED and d.rel_l2 > _MISREAD * torch.finfo(torch.float32).eps]
        if far:
            return Finding.NOT_JUDGED, f"a slice differs far beyond rounding (rel_l2 {far[0].rel_l2:.2g}): the batch " \
                                       f"was likely misread here (a tensor of the batch's size that is not the batch)", ()
        if diffs and all(d is _SCALED for d in diffs):
            return Finding.MEAN, f"its result scales with the rows given (x{self.batch}/rows): it divides by the " \
                                 f"batch size", ()
        return (Finding.VARIANT if diffs else Finding.INVARIANT), None, tuple(d for d in diffs if d is not _SCALED)

    def _slices(self, op: OpRecord, values: list, batched: list[tuple[TensorRef, BatchDim]], loose: bool = False
                ) -> tuple[list, list[SliceDiff]]:
        """Run the op on each slice: the outputs that hold the batch with their batch dimension, and the slices
        whose outputs differ from the recorded rows. ``loose``: a try after the op refused the slice, cutting too
        every input but a parameter that has the batch's size where one that holds it has the batch (a tensor the
        trace made batch-shaped from a buffer and a weight: BERT's token type embeddings)."""
        dim_of = self._broadcasts(batched, loose)
        self._check_all_cut(op, batched, dim_of)
        kept: list = []
        diffs: list[SliceDiff] = []
        recorded: dict[int, torch.Tensor] = {}
        for s, rows in enumerate(self.rows):
            func, args, kwargs = self.replayer.recorded_call(op)
            span = (rows.start, rows.stop)
            args = [self._cut(r, a, span, dim_of) for r, a in zip(op.args, args)]
            args = [self._resize(a, op, batched, rows) for a in args]
            kwargs = {k: self._cut(op.kwargs[k], v, span, dim_of) for k, v in kwargs.items()}
            out = func(*args, **kwargs)
            for n, c in enumerate(values):
                value = pick(out, args, kwargs, c.where, c.sizes)
                if not isinstance(value, torch.Tensor):
                    raise _Unclear(f"{c.label} is {type(value).__name__} on a slice, a tensor when recorded")
                ref = c.recorded
                if n not in recorded:
                    recorded[n] = self.rt.tensor(ref)
                rec = recorded[n]
                d = _shrunk(tuple(rec.shape), tuple(value.shape), self.batch, rows)
                if d is None:
                    continue
                if s == 0:
                    kept.append((c, d))
                start, length = d.span(span)
                diff = _compare(rec.narrow(d.dim, start, length), value, rows, c.label, self.batch)
                if diff is not None:
                    diffs.append(diff)
        return kept, diffs

    def _resize(self, arg: Any, op: OpRecord, batched: list[tuple[TensorRef, BatchDim]], rows: Rows) -> Any:
        """A size argument that is the shape of one of the op's outputs (select_backward's input_sizes, new_zeros'
        size) with the batch's entry made the slice's: at the batch dimension of an input of as many dimensions."""
        if not (isinstance(arg, list) and arg and all(type(x) is int for x in arg)):
            return arg
        if not any(tuple(arg) == tuple(r.shape) for r in op.outputs_refs()):
            return arg
        n = rows.stop - rows.start
        for ref, d in batched:
            if len(ref.shape) <= len(arg) and arg[d.dim] == ref.shape[d.dim] == self.batch * d.block:
                return [n * d.block if i == d.dim else x for i, x in enumerate(arg)]
        return arg

    def _check_all_cut(self, op: OpRecord, batched: list[tuple[TensorRef, BatchDim]],
                       dim_of: Callable[[TensorRef], BatchDim | None]) -> None:
        """_Unclear when an input that would be cut is not: one computed from the batch (or a view of a storage that
        holds it) where the walk lost the batch, shaped as a batch-holding input beside it. A kernel given a cut
        query and a whole key (attention's backward) does not check that their sizes agree: it reads and writes past
        their ends."""
        for r in op.inputs():
            if r.stride is None or dim_of(r) is not None or not (r.version in self.layouts or r.version in self.derived):
                continue
            for other, d in batched:
                if len(r.shape) == len(other.shape) and r.shape[d.dim] == other.shape[d.dim] and r.shape[d.dim] > 1:
                    raise _Unclear(f"an input {r.describe()} computed from the batch is shaped as the batch-holding "
                                   f"{other.describe()}, but where its batch is was not followed")

    def _reproduces(self, op: OpRecord, values: list) -> bool:
        """Whether the op run on the whole batch gives its recorded bits: the control that makes a slice's
        difference the batch's doing."""
        try:
            func, args, kwargs = self.replayer.recorded_call(op)
            out = func(*args, **kwargs)
        except TraceError:
            raise
        except Exception:  # (it ran on slices of these inputs: a failure here is no reproduction either)
            return False
        for c in values:
            value = pick(out, args, kwargs, c.where, c.sizes)
            m = measure(self.rt.tensor(c.recorded), value, exact=True)
            if not isinstance(m, ExactMismatch) or m.mismatches:
                return False
        return True

    def _broadcasts(self, batched: list[tuple[TensorRef, BatchDim]], loose: bool = False
                    ) -> Callable[[TensorRef], BatchDim | None]:
        """The batch dimension of each input: its own, or, for one broadcast along the batch (stride 0 there, as
        the gradient of a mean expanded to the batch's shape), that of an input of as many dimensions beside it;
        ``loose`` (see ``_slices``): that of any input it matches there, unless it is a parameter."""
        def dim_of(ref: TensorRef) -> BatchDim | None:
            d = self.dim(ref)
            if d is not None or ref.stride is None:
                return d
            for other, od in batched:
                if od.dim >= len(ref.shape) or ref.shape[od.dim] != other.shape[od.dim]:
                    continue
                if len(other.shape) == len(ref.shape) and ref.stride[od.dim] == 0:
                    return od
                if loose and od.block == 1 and (ref.version in self.produced or not ref.requires_grad):
                    return od
            return None
        return dim_of

    def _cut(self, rec: Any, built: Any, span: tuple[int, int], dim_of: Callable[[TensorRef], BatchDim | None]
             ) -> Any:
        """``built`` (an argument as replay rebuilt it) with its batch cut to the rows ``span``."""
        if isinstance(rec, TensorRef):
            d = dim_of(rec)
            if d is None or not isinstance(built, torch.Tensor):
                return built
            start, length = d.span(span)
            cut = built.narrow(d.dim, start, length)
            # in a storage of its own, as a run on these rows alone would hold it: a kernel's path can follow the
            # data's alignment (MKL's does), and a cut at row r starts r rows into the recorded storage
            return cut if 0 in cut.stride() else cut.clone(memory_format=torch.preserve_format)
        if isinstance(rec, list) and isinstance(built, (list, tuple)) and len(rec) == len(built):
            return type(built)(self._cut(r, b, span, dim_of) for r, b in zip(rec, built))
        return built


def _draws(op: OpRecord) -> bool:
    """Whether a random op draws anything that shapes its result: not a dropout with probability 0 (attention's
    kernels are random ops for their dropout_p) or out of training."""
    try:
        schema = aten.resolve(op.name)._schema.arguments
    except Exception:
        return True
    given = {a.name: a.default_value for a in schema if a.has_default_value()}
    given |= dict(zip([a.name for a in schema], op.args)) | dict(op.kwargs)
    for p in ("dropout_p", "p"):
        if p in given:
            return given[p] not in (0, 0.0) and given.get("train", True) is not False
    return True


def _shrunk(recorded: tuple, sliced: tuple, batch: int, rows: Rows) -> BatchDim | None:
    """The output's batch dimension: the one that shrank with the slice; None when none did (the output does not
    hold the batch). _Unclear when the shapes changed otherwise."""
    if recorded == sliced:
        return None
    changed = [d for d, (a, b) in enumerate(zip(recorded, sliced)) if a != b] if len(recorded) == len(sliced) else []
    n = rows.stop - rows.start
    if len(changed) == 1:
        d = changed[0]
        if recorded[d] % batch == 0 and sliced[d] == n * (recorded[d] // batch):
            return BatchDim(d, recorded[d] // batch)
    raise _Unclear(f"the slice run's output is {list(sliced)} for recorded {list(recorded)}: which dimension holds "
                   f"the batch is unclear")


# A batch-variant kernel changes a slice in its last bits (rel_l2 about 1e-7 in float32); one far past that (1e4 times
# float32's eps, beyond bfloat16's rounding too) is no reduction order: the batch was taken where it is not.
_MISREAD = 1e4

_SCALED = object()  # a slice's result that is the recorded one scaled by batch/rows: a mean's divisor


def _compare(rec: torch.Tensor, value: torch.Tensor, rows: Rows, label: str, batch: int) -> Any:
    """None when the slice's output has the recorded bits; ``_SCALED`` when it is the recorded one times
    batch/rows to within rounding (the gradient of a mean over the batch divides by the rows it is given: that is
    the op's definition, not the kernel's order); else the ``SliceDiff``."""
    m = measure(rec, value, exact=True)
    if isinstance(m, ExactMismatch) and m.mismatches == 0:
        return None
    if rec.dtype.is_floating_point and value.dtype == rec.dtype and value.shape == rec.shape and rec.numel():
        eps = torch.finfo(rec.dtype).eps
        scaled = rec.to(torch.float64) * (batch / (rows.stop - rows.start))
        if torch.allclose(value.to(torch.float64), scaled, rtol=8 * eps, atol=0.0, equal_nan=True):
            return _SCALED
    mismatches = m.mismatches if isinstance(m, ExactMismatch) else rec.numel()
    rel, big = float("nan"), float("nan")
    ulps = 0
    if rec.dtype.is_floating_point and value.dtype == rec.dtype and value.shape == rec.shape:
        e = measure(rec, value)
        e = e.finite if isinstance(e, NonfiniteMismatch) else e
        if isinstance(e, FloatError):
            rel, big = e.rel_l2, e.max_abs
        ulps = ulp_distance(rec, value)
    return SliceDiff(rows=rows, output=label, mismatches=mismatches, elements=rec.numel(), max_ulps=ulps,
                     rel_l2=rel, max_abs=big)


_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two floating tensors of one dtype in units in the last place: how many values
    of the dtype lie between them (their bit patterns as ordered integers; NaN positions left out)."""
    ints = _INTS.get(a.dtype.itemsize)
    if ints is None or not a.numel():
        return 0
    keep = ~(torch.isnan(a) | torch.isnan(b))
    ia = a.contiguous().view(ints)[keep].to(torch.int64)
    ib = b.contiguous().view(ints)[keep].to(torch.int64)
    top = (1 << (8 * a.dtype.itemsize - 1)) - 1  # all bits but the sign

    def ordered(i: torch.Tensor) -> torch.Tensor:  # negative floats count down from zero
        return torch.where(i < 0, -(i & top), i)

    if not ia.numel():
        return 0
    return int((ordered(ia) - ordered(ib)).abs().max())
