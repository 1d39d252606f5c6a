"""Replaying one op in isolation from its recorded inputs, and judging what it produced.

Inputs are rebuilt per op from the recorded storage bytes: one base tensor per (storage version, dtype), and each
argument as a strided view of it (with its conj and neg bits), so aliasing inside the op survives and an in-place
op writes only into its own copy. Floating data and floating dtype arguments follow the precision policy; random ops
keep their recorded dtype and get their recorded generator state back, so the draw is redone and compared exactly.

``OpReplayer`` holds only what is fixed for a whole replay (the trace, the options, the device); everything about one
op lives in local values. A replayer serves one thread: the trace it reads decodes lazily and is not meant for two
threads at once, so each replaying thread or worker makes its own (as ``run_shard`` and ``replay_op`` do).
"""
from __future__ import annotations

import importlib
import math
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import torch

from replaydiff import device as seam
from replaydiff import aten
from replaydiff.compare.metrics import ExactMismatch, FloatError, NonfiniteMismatch, ViewMismatch, measure
from replaydiff.compare.tolerance import reduction_length
from replaydiff.compare.verdict import Verdict, calibrated, judge, judge_measure, scalar_verdict, with_precision
from replaydiff.errors import TraceError
from replaydiff.replay import references  # what to run instead of a kernel
from replaydiff.replay.compared import VALUES, VIEW, compared_outputs, output_name
from replaydiff.replay.flow import data_slots, follow_nonfinite, remembered
from replaydiff.replay.nonfinite_source import NonfiniteSource, computed_by, first_recorded
from replaydiff.replay.notes import (Failed, FellBack, Judgement, LeftOut, Note, RepeatsDisagree, ReplayFact, Skipped,
                                     render, verdict_reason)
from replaydiff.replay.policy import FALLBACKS, Precision, ReplayOptions, random_draw_caveat, target_dtype
from replaydiff.replay.result import NonfiniteInput, OpResult, Status
from replaydiff.rebuild_and_judge import as_recorded, pick, same_nonfinite, typed_storage
from replaydiff.trace.codec import copy_bytes
from replaydiff.trace.reader import RankTrace
from replaydiff.trace.schema import LEFT_OUT_WHY, Opaque, OpRecord, TensorRef, dtype_from_name, iter_refs

# Held while torch.utils.deterministic.fill_uninitialized_memory is turned off (see _leave_out_unwritten).
_UNFILLED = threading.Lock()

# The finest reference: what an op's own error at its recorded dtype is measured against (see _calibrate).
_FINEST = Precision.FP64

# (recorded TensorRef or scalar, replayed value) for each output and written argument of one run
Pairs = list[tuple[Any, Any]]


class Skip(Exception):
    """This op is not replayed; the message is the reason. ``unjudged``: the op did real computation that replay
    could not run (a compiled unit without a replayable graph), so what it computed is unchecked: never clean."""

    def __init__(self, why: str, unjudged: bool = False) -> None:
        super().__init__(why)
        self.unjudged = unjudged


_PLAIN = frozenset({int, float, bool, str, type(None)})  # argument types passed on as they are


class _Inputs:
    """The arguments of one run of one op: recorded tensors rebuilt at a precision on a device."""

    def __init__(self, trace: RankTrace, precision: Precision, keep_dtype: bool, device: torch.device,
                 generator: torch.Generator | None, uninitialised_fill: float | None = None,
                 shared: "SharedBases | None" = None, written: frozenset = frozenset()) -> None:
        self.trace = trace
        self.precision = precision
        self.keep_dtype = keep_dtype
        self.device = device
        self.generator = generator
        # Memory an empty* op handed out (and nothing wrote since) filled with this value instead of its recorded
        # bytes: which outputs follow the fill tells which positions are the allocator's (see _uninitialised).
        self.uninitialised_fill = uninitialised_fill
        self._base: dict[tuple, torch.Tensor] = {}
        # Bases kept from earlier ops (a weight read by many), and at the recorded dtype on the CPU the reader's
        # decoded bytes themselves: given only for an aten op, and only for storages it does not write (``written``:
        # the storage versions of the arguments its schema marks written), so that no op can change a base another
        # op, or the comparison of a recorded tensor, then reads.
        self.shared = shared
        self.written = written

    def tensor(self, ref: TensorRef) -> torch.Tensor:
        if not ref.stored_data or ref.unsupported:
            if ref.zero:
                rec_dtype = dtype_from_name(ref.dtype)
                target = rec_dtype if self.keep_dtype else target_dtype(self.precision, rec_dtype)
                return torch._efficientzerotensor(ref.shape, dtype=target, device=self.device)
            if ref.meta:
                return ref.empty_meta()
            if ref.unsupported:
                raise Skip(f"an input is not recorded ({ref.unsupported} tensors are not supported)")
            raise Skip("inputs not stored in the trace" + (" (recorded with tensors=meta/stats or a filter)"
                                                           if ref.version is not None else ""))
        rec_dtype = dtype_from_name(ref.dtype)
        target = rec_dtype if self.keep_dtype else target_dtype(self.precision, rec_dtype)
        version = ref.version
        key = (version, ref.dtype, target)
        base = self._base.get(key)
        shared = self.shared if self.uninitialised_fill is None and version not in self.written else None
        if base is None and shared is not None:
            if target == rec_dtype and self.device.type == "cpu":
                # Read only: the decoded bytes as they are (allocated by torch, so aligned as a copy would be).
                base = self._base[key] = typed_storage(self.trace.data(ref), rec_dtype)
                return as_recorded(base, *ref.layout)
            base = shared.get(key, self.device)
            if base is not None:
                self._base[key] = base
        if base is None:
            raw = self.trace.data(ref)
            if self.uninitialised_fill is not None and ref.uninitialised:
                n = typed_storage(raw, rec_dtype).numel()
                base = torch.full((n,), self.uninitialised_fill, dtype=target, device=self.device)
            elif target == rec_dtype and self.device.type == "cpu":
                # The same bytes, copied outside torch: a torch copy is an intra-op parallel region, and at
                # --precision same the engine runs the recorded thread count, whose wake-ups cost more than small
                # copies. Allocated by torch, so aligned as a torch copy is (MKL's results may depend on alignment).
                base = typed_storage(copy_bytes(raw), rec_dtype)
            else:
                base = typed_storage(raw, rec_dtype).to(device=self.device, dtype=target, copy=True)
            self._base[key] = base
            if shared is not None:
                shared.put(key, self.device, base)
        return as_recorded(base, *ref.layout)

    def value(self, v: Any) -> Any:
        if type(v) in _PLAIN:  # most arguments besides tensors: sizes, dims, flags
            return v
        if isinstance(v, TensorRef):
            return self.tensor(v)
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if isinstance(v, Opaque):
            if v.kind == "generator":
                if self.generator is None:
                    raise Skip("a generator argument without recorded state")
                return self.generator
            raise Skip(f"an argument of kind {v.kind!r} cannot be rebuilt")
        if isinstance(v, torch.dtype):  # floating dtype arguments follow the policy
            return v if self.keep_dtype else target_dtype(self.precision, v)
        if isinstance(v, torch.device):  # the replay device, except the meta device (shape computations)
            return v if v.type == "meta" else self.device
        return v

    def build(self, op: OpRecord) -> tuple[list, dict]:
        return [self.value(a) for a in op.args], {k: self.value(v) for k, v in op.kwargs.items()}


class SharedBases:
    """Input bases (one storage version at one dtype on one device) kept across the ops of one replayer, newest
    last, at most ``limit`` bytes: the weights and activations a step reads many times are decoded and upcast once.

    Only aten ops are given these, for the arguments their schema does not mark written, so a base is never
    written."""

    def __init__(self, limit: int = 64 << 20) -> None:
        self.limit = limit
        self._bases: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def get(self, key: tuple, device: torch.device) -> torch.Tensor | None:
        k = key + (device,)
        base = self._bases.get(k)
        if base is not None:
            self._bases.move_to_end(k)
        return base

    def put(self, key: tuple, device: torch.device, base: torch.Tensor) -> None:
        size = base.numel() * base.element_size()
        if size > self.limit // 4:
            return  # one large tensor would push out every other
        self._bases[key + (device,)] = base
        self._bytes += size
        while self._bytes > self.limit:
            _, old = self._bases.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()


class OpReplayer:
    UNWRITTEN_TRIES = 4  # runs to find the positions a kernel leaves unwritten (see _leave_out_unwritten)

    def _processors(self, dev: torch.device, recorded: bool) -> int | None:
        """Multiprocessors of ``dev``: of the recording's device as its trace says, or of this machine's."""
        key = (dev.type, dev.index or 0, recorded)
        if key not in self._processor_counts:
            devices = self.trace.environment.devices if recorded else seam.RUNTIME.facts()
            self._processor_counts[key] = next((d.processors for d in devices
                                                if (d.type, d.index) == key[:2]), None)
        return self._processor_counts[key]

    def __init__(self, trace: RankTrace, options: ReplayOptions) -> None:
        self._processor_counts: dict[tuple, int | None] = {}
        self.trace = trace
        self.opts = options
        self.device = torch.device(options.device)
        self.shared = SharedBases()
        # What following NaN/Inf forward (replay/flow.py) learnt, kept for the next op that makes or lets in some:
        # each op's non-finite outputs, and the ops known to pass them on to where the step keeps them.
        self._nonfinite_slots = remembered(data_slots(trace))
        self._nonfinite_kept: set[int] = set()
        self._sources: dict[int, NonfiniteSource | None] = {}  # not-replayed producer -> where its NaN/Inf began
        self._earliest: dict[int, int] = {}  # what those walks learnt: op -> the earliest op its NaN/Inf came through
        self._kinds: dict[str, tuple[bool, bool, bool, bool]] = {}  # op name -> unit, collective, marker, selected
        self._references: dict[str, tuple[Any, bool, Note | None, bool]] = {}  # op name -> _reference(name)

    # -- one op -----------------------------------------------------------------------------------------------
    def replay(self, op: OpRecord) -> OpResult:
        return self.replay_with_pairs(op)[0]

    def replay_with_pairs(self, op: OpRecord) -> tuple[OpResult, Pairs]:
        """The result, and (recorded, reference) pairs of every output compared (TensorRef and tensor for data)."""
        pairs: Pairs = []
        outputs_finite: bool | None = None
        try:
            judgement, pairs, outputs_finite = self._replay(op)
        except TraceError:
            raise  # a damaged trace is the user's problem to hear about (exit 3), not one op's error
        except Skip as s:
            judgement = Judgement(Status.SKIPPED, notes=(Skipped(str(s)),), unjudged=s.unjudged)
        except Exception as exc:  # one failing op never stops the replay
            judgement = Judgement(Status.ERROR, notes=(Failed.of(exc),))
        origin: tuple[bool, NonfiniteInput | None, bool] = (False, None, False)
        discarded_by: list[int] | None = None
        if outputs_finite is not True:
            try:
                # outputs_finite False: the replay saw the op produce NaN/Inf; None: it could not tell
                origin = self._nonfinite_origin(op, produced=outputs_finite is False)
                if origin[0] or origin[1] is not None:
                    # made or let in here: are they used, or selected away (T5's log(0) under a where)?
                    flow = follow_nonfinite(self.trace, op.index, self._nonfinite_slots, self._nonfinite_kept)
                    discarded_by = list(flow.ended_at) if flow.discarded else None
                    if flow.discarded and origin[1] is not None and origin[1].argument is not None:
                        origin, discarded_by = (False, None, False), None  # a mask's -inf, meant and ended
            except TraceError:
                raise
            except Exception:
                pass  # the origin is a hint; the op's status already says what went wrong reading it
        return self._result(op, judgement, *origin, discarded_by), pairs

    def _result(self, op: OpRecord, j: Judgement, nonfinite_origin: bool,
                nonfinite_input: NonfiniteInput | None = None, from_inf: bool = False,
                discarded_by: list[int] | None = None) -> OpResult:
        """The one place an op's result is made: from its judgement, the notes written as its reason."""
        return OpResult(rank=self.trace.rank, index=op.index, op=op.name, status=j.status, module=op.module,
                        phase=op.phase, source=op.source, forward_index=op.forward_index, verdict=j.verdict,
                        location=self.trace.location(op),
                        reason=render(j.notes), nonfinite_origin=nonfinite_origin, nonfinite_input=nonfinite_input,
                        nonfinite_from_inf=from_inf, nonfinite_discarded_by=discarded_by,
                        collective=j.collective,
                        repeats_disagree=j.repeats_disagree, data_left_out=op.data_left_out, unjudged=j.unjudged)

    def _replay(self, op: OpRecord) -> tuple[Judgement, Pairs, bool | None]:
        """Replay and judge the op: its judgement, the pairs compared and whether every output was finite."""
        name = op.name
        if op.data_left_out is not None:  # some outputs or inputs have statistics only: nothing to judge it by
            raise Skip(f"tensor data left out: {LEFT_OUT_WHY.get(op.data_left_out, op.data_left_out)}")
        kind = self._kinds.get(name)
        if kind is None:  # what the name says of an op, worked out once per name
            kind = self._kinds[name] = (aten.is_unit(name), aten.is_collective(name), aten.is_marker(name),
                                        aten.matches_any(name, self.opts.ops))
        unit, collective, marker, selected = kind
        # a compiled unit (record/unit_capture.py): its graph interpreted (replay/unit_replay.py)
        if unit:
            from replaydiff.replay.unit_replay import UnitReplayer
            return UnitReplayer(self, _Inputs, Skip).replay(op)
        if collective:
            if aten.is_wait_only(name):
                raise Skip("collective bookkeeping: no data of its own")
            return Judgement(Status.SKIPPED, notes=(ReplayFact.COLLECTIVE,), collective=True), [], None
        if marker:
            raise Skip(f"non-aten op ({aten.namespace(name)})")
        if op.uninitialised:
            raise Skip("uninitialised output (empty*)")
        if not selected:
            raise Skip("not selected by --op")
        reference = self._references.get(name)
        if reference is None:  # (an op that cannot be resolved raises Skip each time)
            try:
                reference = self._references[name] = self._reference(name)
            except Skip as s:  # not registered here: what it computed is unchecked, so never clean
                raise Skip(str(s), unjudged=any(True for _ in iter_refs(op.outputs))) from None
        func, seeded, note, note_always = reference
        keep_dtype = seeded or name in aten.DTYPE_EXACT_OPS or self.opts.precision is Precision.SAME
        exact = self.opts.precision is Precision.SAME or seeded
        rng = op.rng
        if seeded:
            if rng is None:
                raise Skip("random op without a recorded generator state")
            rec_dev = torch.device(rng.device)
            if rec_dev.type != self.device.type:
                raise Skip(f"random op recorded on {rec_dev.type}: its draw can only be redone on {rec_dev.type}")
            if rec_dev.type != "cpu":
                numel = max((math.prod(r.shape) for r in iter_refs(op.outputs) if r.shape is not None), default=0)
                caveat = random_draw_caveat(numel, self._processors(rec_dev, recorded=True),
                                            self._processors(self.device, recorded=False))
                if caveat is not None:
                    raise Skip(caveat)
        if self.opts.precision is Precision.SAME:
            devs = {r.device.split(":")[0] for r in iter_refs(op.outputs) if isinstance(r.device, str)}
            if devs and devs != {self.device.type}:
                exact = False  # another backend: judged by the dtype's tolerance instead of bit for bit

        # Some kernels have no float64 (or float32) version (aten._grouped_mm in MoE layers): such an op is replayed
        # at the next precision down, and the report says so.
        ladder = [self.opts.precision] if keep_dtype else list(FALLBACKS[self.opts.precision])
        first_failure = None
        for step, precision in enumerate(ladder):
            keep = keep_dtype or precision is Precision.SAME
            try:
                runs = self._runs(op, func, seeded, precision, keep)
                if note is ReplayFact.DECOMPOSITION and runs[0][0] is NotImplemented:
                    # The decomposition does not cover these arguments: no decomposition for this call, so the op's
                    # own kernel, as for an op without one (say so only where a problem is reported).
                    func, note = self._resolve(name), ReplayFact.DECOMPOSITION_DECLINED
                    runs = self._runs(op, func, seeded, precision, keep)
                break
            except (RuntimeError, NotImplementedError) as exc:
                if step == len(ladder) - 1:
                    raise
                first_failure = first_failure or f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:200]
        fell_back = precision != ladder[0]
        if fell_back:
            keep_dtype = keep

        j, pairs, finite = self._judge(op, func, runs, exact, keep_dtype, precision, seeded)
        notes = j.notes
        if note and (note_always or j.status is not Status.OK):
            notes += (note,)
        if fell_back:
            notes += (FellBack(precision, ladder[0], first_failure),)
            if j.verdict is not None:
                j = replace(j, verdict=with_precision(j.verdict, precision))
        return (j if notes is j.notes else replace(j, notes=notes)), pairs, finite  # replace() costs ~5 us

    def recorded_call(self, op: OpRecord) -> tuple[Any, list, dict]:
        """The op's kernel and its arguments rebuilt at their recorded dtypes on the replay device, each in its own
        copy (an in-place op writes only into it): ``(func, args, kwargs)`` for a caller that runs the op on inputs
        of its own making (a slice of the batch). Raises ``Skip`` with the reason where the op cannot be rebuilt."""
        if op.data_left_out is not None:
            raise Skip(f"tensor data left out: {LEFT_OUT_WHY.get(op.data_left_out, op.data_left_out)}")
        func = self._resolve(op.name)
        args, kwargs = _Inputs(self.trace, Precision.SAME, True, self.device, None).build(op)
        return func, args, kwargs

    def _reference(self, name: str) -> tuple[Any, bool, Note | None, bool]:
        """What to run for the op: (callable, is it a random op, what the reference is, whether every result says
        so or only a problem does: under --reference decomp most ops run through one)."""
        fn = references.registered_reference(name)
        if fn is not None:  # a user's reference: the op itself need not be loadable here
            try:
                seeded = aten.facts(aten.resolve(name)).seeded
            except aten.UnknownOp:
                seeded = False
            return fn, seeded, ReplayFact.REGISTERED_REFERENCE, True
        func = self._resolve(name)
        seeded = aten.facts(func).seeded
        if self.opts.reference == "decomp" and not seeded:  # a decomposition would draw other random numbers
            decomp = references.decomposition(func)
            if decomp is not None:
                return decomp, False, ReplayFact.DECOMPOSITION, False
        return func, seeded, None, False

    def _resolve(self, name: str) -> Any:
        try:
            return aten.resolve(name)
        except aten.UnknownOp as exc:
            module = self.trace.custom_ops.get(name)
            if module is None:
                raise Skip(str(exc)) from None
            if not module.startswith("torch."):
                raise Skip(f"op {name} is defined in Python module {module}: replay with --import {module}") from None
            try:  # torch's own Python-defined ops (fsdp::, torch_nn::): safe to import, and needed
                importlib.import_module(module)
                return aten.resolve(name)
            except Exception as exc2:
                raise Skip(f"op {name} is defined in {module}, which could not be imported here "
                           f"({type(exc2).__name__}: {exc2})") from None

    def _generator(self, op: OpRecord) -> torch.Generator | None:
        """A generator holding the recorded state when the op was given one explicitly; None when it drew from
        the device's default generator (whose state is restored around the call instead)."""
        if not any(isinstance(v, Opaque) and v.kind == "generator" for v in [*op.args, *op.kwargs.values()]):
            return None
        gen = torch.Generator(device=self.device)
        gen.set_state(self.trace.rng_state(op.rng))
        return gen

    def _runs(self, op: OpRecord, func: Any, seeded: bool, precision: Precision, keep_dtype: bool) -> list[tuple]:
        runs = []
        # Inputs kept from earlier ops only for an aten op (a Python reference or decomposition could write
        # anything), and only those it does not write; each repeat then runs on the same inputs, as it does anyway.
        shared, written = None, frozenset()
        if isinstance(func, torch._ops.OpOverload) and not seeded:
            shared = self.shared
            facts = aten.facts(func)
            if facts.writes:
                written = frozenset(r.version for v in aten.written_values(facts, op.args, op.kwargs)
                                    for r in iter_refs(v))
        for _ in range(max(1, self.opts.repeat)):
            gen = self._generator(op) if seeded else None
            args, kwargs = _Inputs(self.trace, precision, keep_dtype, self.device, gen, shared=shared,
                                   written=written).build(op)
            if seeded and gen is None:
                with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
                    state = self.trace.rng_state(op.rng)
                    seam.RUNTIME.set_rng_state(state, self.device)
                    out = func(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
            runs.append((out, args, kwargs))
        return runs

    def _judge(self, op: OpRecord, func: Any, runs: list, exact: bool, keep_dtype: bool,
               precision: Precision, seeded: bool) -> tuple[Judgement, Pairs, bool | None]:
        """The op's judgement from its runs, the pairs compared and whether every output was finite."""
        out, args, kwargs = runs[0]
        packet = aten.packet(op.name)
        in_shapes: list = []  # made at the first tensor judged (an op of views has none)

        def k_for(numel: int) -> int:
            if not in_shapes:
                in_shapes.append([list(r.shape) for r in iter_refs(op.args)])
            return reduction_length(packet, in_shapes[0], max(1, numel))

        k_of = lambda n: k_for(pairs[n][1].numel())  # noqa: E731
        pairs = _pairs(op, out, args, kwargs, keep_dtype)
        if not pairs:
            unsupported = [r.unsupported for r in op.outputs_refs() if r.unsupported]
            if unsupported:  # e.g. a sparse output: not recorded, so nothing can be checked
                raise Skip(f"output not recorded ({unsupported[0]} tensors are not supported)")
        judged: list[tuple[int, Verdict]] = []
        for n, (ref, value) in enumerate(pairs):
            if isinstance(ref, ViewMismatch):
                v = judge_measure(ref, "", self.opts.tolerances)
                return Judgement(Status.DIVERGENT, v, verdict_reason(v.reason)), pairs, None
            if not isinstance(value, torch.Tensor):
                if isinstance(ref, TensorRef):
                    raise RuntimeError(f"op returned {type(value).__name__} where a tensor was recorded")
                v = scalar_verdict(ref, value)
                if v is not None:
                    return Judgement(Status.DIVERGENT, v, verdict_reason(v.reason)), pairs, None
                continue
            recorded = self.trace.tensor(ref)
            v = judge(recorded, value, self.opts.tolerances, k_for(recorded.numel()), exact)
            judged.append((n, v))
        # a random op's draw overwrites what it fills (and would need its generator state to run again)
        allocators = {} if seeded else self._uninitialised(op, func, precision, keep_dtype)
        if allocators:
            judged = [(n, self._judge_without(pairs[n], allocators[n], k_of(n), exact))
                      if n in allocators else (n, v) for n, v in judged]
        # Whether the op made a NaN/Inf, judged on what it produced (the positions left out above are not)
        finite = not any(_nonfinite_recorded(v.measure) for _, v in judged)
        if not keep_dtype and any(v.divergent and isinstance(v.measure, (FloatError, NonfiniteMismatch))
                                  for _, v in judged):
            judged = self._calibrate(op, func, pairs, judged, allocators)
        if not seeded and any(v.divergent for _, v in judged):
            judged = self._leave_out_unwritten(op, func, pairs, judged, precision, keep_dtype, exact, k_of=k_of,
                                               left_out=allocators)
        bad = [(n, v) for n, v in judged if v.divergent]
        left_out = sum(v.left_out for _, v in judged)
        status, verdict = Status.OK, None
        notes: tuple[Note, ...] = ()
        if bad:
            status, (n, verdict) = Status.DIVERGENT, bad[0]
            notes = verdict_reason(verdict.reason)
        elif judged:
            # The output nearest its limit; but an output over the fixed limits that is ok (ill-conditioned) first,
            # so the op's figures a reader takes for a divergence come with why they are not one.
            n, verdict = judged[0] if len(judged) == 1 else \
                max(judged, key=lambda nv: (nv[1].explanation is not None, nv[1].severity))
            notes = verdict_reason(verdict.explanation)
        else:
            notes = (ReplayFact.SCALAR_EXACT if pairs else ReplayFact.NOTHING_TO_COMPARE,)
        if verdict is not None and len(pairs) > 1:  # which of the op's results the figures are of
            verdict = replace(verdict, output=output_name(op, pairs[n][0]))
        if left_out:
            notes += (LeftOut(left_out, uninitialised=bool(allocators)),)
        # evidence of a non-deterministic kernel, whatever the status
        disagree = len(runs) > 1 and _repeats_disagree(runs)
        if disagree and status is Status.OK:
            status, notes = Status.NONDETERMINISTIC, (RepeatsDisagree(len(runs)),)
        # Outputs that are all views of inputs (whose bytes they share) count as finite: a NaN there started earlier.
        return (Judgement(status, verdict, notes, repeats_disagree=disagree), pairs,
                (finite if len(judged) == len(pairs) else None))

    def _calibrate(self, op: OpRecord, func: Any, pairs: Pairs, judged: list[tuple[int, Verdict]],
                   left_out: dict[int, torch.Tensor]) -> list[tuple[int, Verdict]]:
        """Is an error over the fixed limit explained by the op's own conditioning?

        The op is run again at its recorded dtypes (on the CPU), and that run's error against the
        upcast reference is the op's own error at this precision (large for ill-conditioned ops: a LayerNorm of
        an input with a large mean, a gradient sum that cancels to almost zero). An output is divergent only if
        its recorded error is more than ``conditioning_factor`` times that. Positions in ``left_out`` (memory an
        empty* op handed out) are not measured.

        Where the reference is no finer than the recorded dtype (a float32 op at ``--precision fp32``), the
        reference is that dtype's own run, against which the op's own error is 0: the output is then judged, and
        the op's own error measured, against a float64 run on the CPU instead, as at the default precision, so an
        ill-conditioned op is recognised whatever the precision asked (the verdict's ``precision`` says fp64).
        """
        # On the CPU whatever the replay device: a kernel bug on the replay GPU must not explain itself away.
        args, kwargs = _Inputs(self.trace, Precision.SAME, True, torch.device("cpu"), None).build(op)
        # the same results as the upcast run compared (kernel-path bookkeeping left out of both), so they align
        same_pairs = _pairs(op, func(*args, **kwargs), args, kwargs, False)
        fine_pairs: Pairs | None = None  # the float64 run, made only when some output needs it
        f = self.opts.tolerances.conditioning_factor
        result = []
        for n, v in judged:
            same, value = same_pairs[n][1] if n < len(same_pairs) else None, pairs[n][1]
            recorded = self.trace.tensor(pairs[n][0]) if v.divergent and isinstance(same, torch.Tensor) else None
            fine = None
            if recorded is not None and isinstance(v.measure, FloatError) and value.dtype == same.dtype \
                    and target_dtype(_FINEST, same.dtype) != same.dtype:
                if fine_pairs is None:
                    fine_pairs = self._fine_pairs(op, func)
                fine = fine_pairs[n][1] if n < len(fine_pairs) else None
                if not (isinstance(fine, torch.Tensor) and fine.shape == value.shape):
                    fine = None  # no float64 run to judge by: the verdict stays the one at the precision asked
            if n in left_out and recorded is not None and same.shape == value.shape:
                keep = ~left_out[n]
                same, value, recorded = same[keep], value[keep], recorded[keep.to(recorded.device)]
                fine = fine[keep] if fine is not None else None
            if v.divergent and isinstance(v.measure, NonfiniteMismatch) and recorded is not None:
                v = self._nonfinite_explained(recorded, same, v)
            if fine is not None:
                v = with_precision(judge(recorded, fine.to(recorded.device), self.opts.tolerances,
                                         v.reduction_k or 1), _FINEST)
                if not v.divergent:
                    result.append((n, v))
                    continue
                value = fine
            if v.divergent and isinstance(v.measure, FloatError) and recorded is not None:
                v = calibrated(v, measure(same, value), str(same.dtype).removeprefix("torch."), f)
            result.append((n, v))
        return result

    def _fine_pairs(self, op: OpRecord, func: Any) -> Pairs:
        """The op run at float64 on the CPU, paired as the replay's run is (empty when it has no such kernel)."""
        try:
            args, kwargs = _Inputs(self.trace, _FINEST, False, torch.device("cpu"), None).build(op)
            return _pairs(op, func(*args, **kwargs), args, kwargs, False)
        except (RuntimeError, NotImplementedError):
            return []

    def _nonfinite_explained(self, recorded: torch.Tensor, same: torch.Tensor, v: Verdict) -> Verdict:
        """NaN/Inf recorded where the upcast reference has none is no divergence when the op makes exactly those
        itself at its recorded dtypes (bf16 matrix_exp overflows inside the kernel): the verdict is then the one
        on the finite positions."""
        if not same_nonfinite(recorded, same):
            return v
        finite = judge_measure(v.measure.finite, recorded.dtype, self.opts.tolerances, v.reduction_k or 1)
        return finite if finite.divergent else replace(finite, reason=None)

    def _uninitialised(self, op: OpRecord, func: Any, precision: Precision, keep_dtype: bool
                       ) -> dict[int, torch.Tensor]:
        """Output positions that hold memory an empty* op handed out: {pair number: mask}, only where some are.

        An op may write only part of an uninitialised buffer it is given (FSDP2's ``all_gather_copy_in`` copies
        this rank's shards into its slot of the all-gather buffer; the other ranks' slots stay ``torch.empty``'s
        until the collective fills them). Those positions are no value the op produced: not compared, and no
        NaN/Inf origin. The op is run twice with such inputs filled with 0 and with 1 instead of their recorded
        bytes; positions that follow the fill are the allocator's (or computed from it)."""
        if not any(r.uninitialised and r.stored for r in op.inputs()):
            return {}
        runs = []
        try:
            for fill in (0.0, 1.0):
                args, kwargs = _Inputs(self.trace, precision, keep_dtype, self.device, None, fill).build(op)
                runs.append(_pairs(op, func(*args, **kwargs), args, kwargs, keep_dtype))
        except (RuntimeError, IndexError, ValueError):  # a fill the op cannot take (garbage used as indices)
            return {}  # then every position is compared, as recorded
        masks = {}
        for n, ((_, a), (_, b)) in enumerate(zip(*runs)):
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
                follows = ~((a == b) | (torch.isnan(a) & torch.isnan(b))) if a.is_floating_point() or \
                    a.is_complex() else a != b
                if bool(follows.any()):
                    masks[n] = follows
        return masks

    def _judge_without(self, pair: tuple, leave_out: torch.Tensor, k: int, exact: bool) -> Verdict:
        """The verdict on the positions of ``pair`` outside ``leave_out`` (memory an empty* op handed out)."""
        ref, value = pair
        recorded = self.trace.tensor(ref)
        keep = ~leave_out
        return replace(judge(recorded[keep.to(recorded.device)], value[keep.to(value.device)],
                             self.opts.tolerances, k, exact), left_out=int(leave_out.sum()))

    def _leave_out_unwritten(self, op: OpRecord, func: Any, pairs: Pairs, judged: list[tuple[int, Verdict]],
                             precision: Precision, keep_dtype: bool, exact: bool, k_of: Any,
                             left_out: dict[int, torch.Tensor]) -> list[tuple[int, Verdict]]:
        """Positions of an output that the kernel never writes (``_ctc_loss``'s log_alpha beyond each sequence)
        hold whatever the allocator handed out, recorded and replayed alike. The op is run again with uninitialised
        memory filled differently (a few times, as the allocator may hand the same NaN-filled block back);
        positions whose value changed depend on no input, and are left out of the comparison (the verdict says
        how many, with the positions already in ``left_out``). Only outputs already judged divergent are examined,
        so this costs nothing on clean ops."""
        import torch.utils.deterministic as det

        floating = {n for n, v in judged if v.divergent and isinstance(pairs[n][1], torch.Tensor)
                    and (pairs[n][1].is_floating_point() or pairs[n][1].is_complex())}
        unwritten = {n: left_out[n].clone() if n in left_out else torch.zeros_like(pairs[n][1], dtype=torch.bool)
                     for n in floating}
        result = judged
        for _ in range(self.UNWRITTEN_TRIES if floating else 0):
            # The flag is process-wide: one thread at a time turns it off, so each puts back what it found.
            with _UNFILLED:
                saved = det.fill_uninitialized_memory
                try:
                    det.fill_uninitialized_memory = False
                    args, kwargs = _Inputs(self.trace, precision, keep_dtype, self.device, None).build(op)
                    # Blocks of the outputs' sizes, filled with a value no kernel computes here and freed at once:
                    # the allocator hands them to the run below, whose unwritten positions then hold that value
                    # rather than the NaN of the first run's fill (or of its freed temporaries, which would look
                    # the same).
                    bait = [torch.full_like(pairs[n][1], 1234.5) for n in floating for _ in range(3)]
                    del bait
                    other = _pairs(op, func(*args, **kwargs), args, kwargs, keep_dtype)
                finally:
                    det.fill_uninitialized_memory = saved
            for n in floating:
                b = other[n][1] if n < len(other) else None
                if isinstance(b, torch.Tensor) and b.shape == pairs[n][1].shape:
                    # Unwritten: NaN in the first run (its fill), something else in this one. Positions that
                    # merely differ (a kernel that is not deterministic) stay compared.
                    unwritten[n] |= torch.isnan(pairs[n][1]) & ~torch.isnan(b)
            result = []
            for n, v in judged:
                count = int(unwritten[n].sum()) if n in unwritten else 0
                if count:
                    written = ~unwritten[n]
                    recorded = self.trace.tensor(pairs[n][0])
                    v = replace(judge(recorded[written.to(recorded.device)], pairs[n][1][written],
                                      self.opts.tolerances, k_of(n), exact), left_out=count)
                result.append((n, v))
            if not any(v.divergent for _, v in result):
                break
        return result

    # -- NaN / Inf origin -------------------------------------------------------------------------------------
    def _nonfinite_origin(self, op: OpRecord, produced: bool = False) -> tuple[bool, NonfiniteInput | None, bool]:
        """For an op with a non-finite recorded output: (True, None, False) when its inputs are finite, the op where
        NaN/Inf entered the step; (True, None, True) when its inputs hold Inf but no NaN and it made NaN of them (a
        softmax over a row masked whole with -inf, inf - inf): the op where NaN entered the step; (False, input, False)
        when an input already held NaN/Inf that no replayed op computed (the first such input, see ``_entered_from``),
        or its inputs are finite and it was passed a NaN/Inf number (``NonfiniteInput.argument``): where they came
        into the step from outside; else (False, None, False).

        ``produced``: the replay saw the op itself produce the non-finite values. Without that, the recorded outputs
        are read, and a position the op left as an empty* op handed it out (its bytes as they were before the op)
        is no value the op produced."""
        outputs = [r for r in op.outputs_refs() if not r.uninitialised and r.stored and aten.floating_dtype(r.dtype)]
        if not produced and not any(self._made_nonfinite(op, r) for r in outputs):
            return False, None, False
        finite, nan_in = True, False
        producers: dict[int, int | None] | None = None
        for k, r in enumerate(op.inputs()):
            if not aten.floating_dtype(r.dtype) or r.uninitialised:
                continue
            if not r.stored:
                finite, nan_in = False, True  # cannot tell what it held: not an origin
                continue
            t = self.trace.tensor(r)
            bad = ~torch.isfinite(t)
            if not bool(bad.any()):
                continue
            finite = False
            nan = int(torch.isnan(t).sum())
            nan_in = nan_in or nan > 0
            producers = self.trace.producers(op.index) if producers is None else producers
            outside, producer = self._entered_from(producers.get(k))
            if outside:
                src = None if producer is None else self._first_recorded(producer)
                earliest = {} if src is None else dict(
                    earliest=src.index, earliest_op=self.trace[src.index].name, earliest_nan=src.nan,
                    earliest_inf=src.inf, earliest_input=src.position, earliest_made=src.made,
                    earliest_argument=src.argument)
                return False, NonfiniteInput(k, nan, int(bad.sum()) - nan, producer,
                                             None if producer is None else self.trace[producer].name,
                                             **earliest), False
        scalars = [x for x in _scalars([op.args, list(op.kwargs.values())]) if isinstance(x, float)]
        if finite:
            # a NaN/Inf passed in as a number (masked_fill(-inf) in attention): not made here but let in, as a
            # tensor from outside the trace is; said only where the step keeps them
            arg = next((x for x in scalars if not math.isfinite(x)), None)
            if arg is None:
                return True, None, False
            position = next((k for k, x in enumerate(op.args) if isinstance(x, float) and not math.isfinite(x)), -1)
            nan = inf = 0
            for r in outputs:
                t = self.trace.tensor(r)
                nan, inf = nan + int(torch.isnan(t).sum()), inf + int(torch.isinf(t).sum())
            held = NonfiniteInput(position, nan, inf, argument=str(arg))
            return False, (held if nan or inf else None), False
        if nan_in or any(math.isnan(x) for x in scalars):
            return False, None, False
        # Inf in, NaN out: the NaN are this op's own, whatever made the Inf (a mask's -inf is meant; the NaN of a
        # softmax over a row of nothing but -inf is not, and its backward reads them from the saved output)
        made = any(self._made_nonfinite(op, r, nan_only=True) for r in outputs)
        return made, None, made

    def _first_recorded(self, producer: int) -> NonfiniteSource | None:
        """Where the NaN/Inf op ``producer`` (not replayed) handed on were first recorded, walked back once per
        producer (every later op that reads them asks again)."""
        if producer not in self._sources:
            self._sources[producer] = first_recorded(self.trace, producer, self._earliest)
        return self._sources[producer]

    def _entered_from(self, producer: int | None) -> tuple[bool, int | None]:
        """Did an input that op ``producer`` made come from outside what replay computes (see ``computed_by``)?
        (True, None): written outside the trace; (True, p): by op p, whose data the recording left out (not
        replayed); (False, p): by op p, replayed, whose own result says where its NaN/Inf came from."""
        p = computed_by(self.trace, producer)
        return (p is None or self.trace[p].data_left_out is not None), p

    def _made_nonfinite(self, op: OpRecord, ref: TensorRef, nan_only: bool = False) -> bool:
        """Does recorded output ``ref`` hold a NaN/Inf (``nan_only``: a NaN) other than bytes of uninitialised memory
        left as they were?"""
        t = self.trace.tensor(ref)
        nonfinite = torch.isnan(t) if nan_only else ~torch.isfinite(t)
        if not bool(nonfinite.any()):
            return False
        before = _uninitialised_before(op).get(ref.version)
        if before is None:
            return True
        size = dtype_from_name(ref.dtype).itemsize
        a, b = self.trace.data(ref), self.trace.data(before)
        n = min(a.numel(), b.numel()) // size
        same = (a[:n * size].view(n, size) == b[:n * size].view(n, size)).all(1)  # per element of the storage
        stale = as_recorded(same, ref.shape, ref.stride, ref.offset).to(nonfinite.device)
        return bool((nonfinite & ~stale).any())


def _uninitialised_before(op: OpRecord) -> dict[Any, TensorRef]:
    """Storage version after the op -> the argument as it was before, for the arguments the op wrote that held
    uninitialised memory (from an empty* op, never written since)."""
    out = {}
    for path, after in op.writes:
        before = op.args[path.key] if path.kind == "arg" and path.key < len(op.args) else op.kwargs.get(path.key)
        for b, a in zip(iter_refs(before), iter_refs(after)):
            if b.uninitialised and b.stored and a.stored and b.nbytes == a.nbytes:
                out[a.version] = b
    return out


def _nonfinite_recorded(m: Any) -> int:
    """NaN/Inf positions in the recorded tensor a measure was taken of (0 when there are none or it cannot say)."""
    return getattr(m, "nonfinite_recorded", 0) or getattr(getattr(m, "finite", None), "nonfinite_recorded", 0) or 0


def _pairs(op: OpRecord, out: Any, args: list, kwargs: dict, recorded_dtypes: bool) -> Pairs:
    """(recorded, replayed) pairs for every result ``compared_outputs`` names; a view or meta output whose geometry
    is not the recorded one is paired as a ViewMismatch, one that matches is left out (its bytes are not its own)."""
    pairs: Pairs = []
    for c in compared_outputs(op, recorded_dtypes):
        value = pick(out, args, kwargs, c.where, c.sizes)
        r = c.recorded
        if c.how == VALUES or not isinstance(r, TensorRef):
            pairs.append((r, value))
        elif isinstance(value, torch.Tensor) and (value.shape != r.shape or value.stride() != (r.stride or ())
                                                  or (c.how == VIEW and value.storage_offset() != r.offset)):
            # (the tuples compared here are the geometry's lists; the dicts are made only for a mismatch)
            geometry = c.geometry
            pairs.append((ViewMismatch({"shape": geometry["shape"], "stride": geometry["stride"],
                                        "offset": r.offset}, _geometry(value)), value))
    return pairs


def _geometry(value: torch.Tensor) -> dict:
    return {"shape": list(value.shape), "stride": list(value.stride()), "offset": value.storage_offset()}


def _tensors(run: tuple) -> list[torch.Tensor]:
    out, args, kwargs = run
    return list(aten.iter_tensors([out, args, list(kwargs.values())]))


def _repeats_disagree(runs: list[tuple]) -> bool:
    first = _tensors(runs[0])
    for other in runs[1:]:
        for a, b in zip(first, _tensors(other)):
            m = measure(a, b, exact=True)
            if not isinstance(m, ExactMismatch) or m.mismatches:
                return True
    return False


def _scalars(v: Any):
    if isinstance(v, (list, tuple)):
        for x in v:
            yield from _scalars(x)
    elif not isinstance(v, TensorRef):
        yield v
