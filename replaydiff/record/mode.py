"""The private dispatch mode that turns every aten op into an op record.

For each op: inputs are described (and their bytes snapshotted once per storage version) *before* the op runs, so
in-place and out= ops keep what they read; the op runs exactly as it would have; outputs and every argument the
schema marks written are described *after* it. Any exception inside the bookkeeping disables recording with one
warning and is never raised into the job; the op itself always runs unchanged.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from replaydiff import aten
from replaydiff import device as seam
from replaydiff.aten import iter_tensors, written_args
from replaydiff.record.budget import DataBudget
from replaydiff.record.context import OpContext
from replaydiff.record.dtensor import note_dtensor_op
from replaydiff.record import native
from replaydiff.record.options import RecordOptions
from replaydiff.record.stats import (DeviceStats, batch_stats, cpu_values, dense_numel, extension, has_stats,
                                     kernel_code, kernel_stats, past_storage, values_stats)
from replaydiff.record.storage import StorageTable
from replaydiff.trace import schema
from replaydiff.trace.codec import address_view
from replaydiff.trace.format import crc32
from replaydiff.trace.modes import TensorMode
from replaydiff.trace.schema import CollectiveInfo
from replaydiff.trace.writer import RankWriter, Snapshot

log = logging.getLogger("replaydiff")

try:  # how dynamo marks a code object it must not compile, nor anything it calls (a C extension: no torch._dynamo)
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    _SKIP_ALL: Any = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    set_code_exec_strategy((lambda: None).__code__, _SKIP_ALL)  # marking works in this torch
except Exception:  # another torch: keep torch's own wrapper (RecordingMode._should_skip_dynamo)
    _SKIP_ALL = None

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
# dtype -> (name as a record spells it, bytes per element, the statistics kernel's code or None, complex?)
_DTYPES: dict[torch.dtype, tuple[str, int, int | None, bool]] = {}
# Values OpBuilder.encode_list keeps as they are, exactly as schema.encode_value would (ints within msgpack's range).
_VERBATIM = frozenset({bool, float, str, type(None)})
_INT_MIN, _INT_END = -(1 << 63), 1 << 64


def _dtype_facts(dtype: torch.dtype) -> tuple[str, int, int | None, bool]:
    facts = _DTYPES[dtype] = (str(dtype).removeprefix("torch."), dtype.itemsize, kernel_code(dtype),
                              dtype.is_complex)  # only a complex tensor can carry the conj bit
    return facts


def _one_line_call(self, /, *args, **kwargs):  # OpOverload.__call__ as torch writes it (2.1 on)
    return self._op(*args, **kwargs)


def calls_its_op(cls: type) -> bool:
    """Whether ``cls.__call__`` is ``_one_line_call`` (the same bytecode, names and constants): only then does
    __torch_dispatch__ call an overload's ``_op`` itself. A torch whose ``__call__`` does more (a hook, a check) keeps
    its own call: skipping it would change what the job runs."""
    code = getattr(getattr(cls, "__call__", None), "__code__", None)
    ref = _one_line_call.__code__
    return code is not None and (code.co_code, code.co_names, code.co_consts) == (ref.co_code, ref.co_names,
                                                                                  ref.co_consts)


# the type whose calls __torch_dispatch__ makes through _op; None where its __call__ is not that one line
_OP_OVERLOAD = torch._ops.OpOverload if calls_its_op(torch._ops.OpOverload) else None
# what aten.fake_mode_active() reads (None in a torch without infra-mode keys), read in __torch_dispatch__ itself
_FAKE_KEY, _get_mode = aten._FAKE_KEY, aten._get_mode
_KERNEL_STATS = kernel_stats  # as imported (OpBuilder: tests replace the module's kernel_stats)


class RecorderLike(Protocol):
    """What the mode needs of the recorder that owns it (``recorder.Recorder``)."""

    active: bool
    next_index: int
    step: int | None  # the optimizer step being recorded (multi-step recordings), stamped on every record
    options: RecordOptions
    storages: StorageTable
    writer: RankWriter
    context: OpContext
    custom_ops: dict[str, str]

    def before(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any: ...
    def after(self, pending: Any, func: Any, args: tuple, kwargs: dict, out: Any) -> Any: ...
    def rng_state(self, args: tuple, kwargs: dict) -> tuple[str, int, int, int] | None: ...
    def disable(self, why: str) -> None: ...
    def op_failed(self, func: Any, args: tuple, kwargs: dict, exc: Exception) -> None: ...
    def warn(self, msg: str) -> None: ...


class RecordingMode(TorchDispatchMode):
    def __init__(self, recorder: RecorderLike) -> None:
        super().__init__()
        self.rec = recorder
        # Autograd's device threads run backward ops while another thread runs its own: an op is numbered, run and
        # handed to the writer by one thread at a time, so numbers stay unique and reach the writer in order.
        self._one_at_a_time = threading.RLock()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch keeps dynamo out of a mode's __torch_dispatch__ by wrapping it in torch._disable_dynamo, whose first
        # call imports torch._dynamo: ~70 MiB of host memory in a job that has not imported it (one that never
        # compiles nor steps a torch.optim optimizer), and two Python frames more on every op. The mark set below
        # the class keeps dynamo out of the mode's frames the same way (recursively), without the import.
        return _SKIP_ALL is None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if not rec.active:
            return func(*args, **kwargs)
        if types and aten.wraps_tensors(types):
            # A wrapper subclass (DTensor under FSDP2 and tensor parallelism): let it unwrap; the ops it runs on its
            # local tensors come back through this mode and are what gets recorded (and can be replayed).
            note_dtensor_op(rec, func, args, kwargs)  # its placements, for the diff of a parallel run
            return NotImplemented
        if _get_mode is not None and _get_mode(_FAKE_KEY) is not None:  # aten.fake_mode_active(), inline
            # Shape propagation on fake tensors (DTensor's sharding rules): no data, nothing computed for the job.
            return func(*args, **kwargs)
        # Bounded: an op that waits for another thread's op while that one runs (a custom op joining a worker
        # thread that runs torch ops) would otherwise hang the job on the recorder's lock. Past the wait the
        # recording stops and the job goes on.
        if not self._one_at_a_time.acquire(timeout=THREAD_WAIT_SECONDS):
            _stop(rec, f"an op ({func}) waited {THREAD_WAIT_SECONDS:g} s for another thread's op to be recorded")
            return func(*args, **kwargs)
        try:
            pending = None
            try:
                pending = rec.before(func, types, args, kwargs)
            except Exception as exc:  # costs this op alone: a stub record says why
                _op_failed(rec, func, args, kwargs, exc)
            # OpOverload.__call__ is one Python line, `return self._op(*args, **kwargs)` (calls_its_op checks it):
            # called here directly for an exact OpOverload (one Python frame fewer an op); anything else (a
            # subclass, another operator type, a torch whose __call__ does more) through its own __call__.
            out = func._op(*args, **kwargs) if type(func) is _OP_OVERLOAD else func(*args, **kwargs)
            if pending is not None:
                try:
                    # a point-to-point collective's work comes back waited and complete (wait_collective says why)
                    out = rec.after(pending, func, args, kwargs, out)
                except Exception as exc:
                    _op_failed(rec, func, args, kwargs, exc)
            return out
        finally:
            self._one_at_a_time.release()


THREAD_WAIT_SECONDS = 60.0  # how long an op waits for another thread's op to be recorded (RecordingMode)


def _stop(rec: Any, why: str) -> None:
    try:
        rec.disable(why)
    except Exception:
        rec.active = False


def _op_failed(rec: Any, func: Any, args: tuple, kwargs: dict, exc: Exception) -> None:
    """The recorder's handling of an op it could not record, which must not fail into the job either: where even
    that fails, the recording stops (one warning) and the job goes on."""
    try:
        rec.op_failed(func, args, kwargs, exc)
    except Exception as exc2:
        _stop(rec, f"{func} could not be recorded ({type(exc).__name__}: {exc}), nor its failure noted "
                   f"({type(exc2).__name__}: {exc2})")


if _SKIP_ALL is not None:  # dynamo never compiles the mode's frames nor those they call (see _should_skip_dynamo)
    set_code_exec_strategy(RecordingMode.__torch_dispatch__.__code__, _SKIP_ALL)


class OpBuilder:
    """The per-op half of the recorder: describes tensors, snapshots storages, builds records."""

    def __init__(self, rec: RecorderLike) -> None:
        self.rec = rec
        self.mode = rec.options.tensors
        self._meta = self.mode is TensorMode.META  # ref() stops at the description
        self._full = self.mode is TensorMode.FULL
        # The statistics extension (native/hotpath.c) where it loads: the kernel's statistics in one call, and
        # dense_numel in C. Loaded here for a statistics recording (its first tensor would); a full one measures
        # few tensors (those over --max-tensor-bytes or the budget), with kernel_stats. Not where kernel_stats was
        # replaced (a test counting or refusing the kernel's calls).
        ext = extension() if self.mode is TensorMode.STATS and kernel_stats is _KERNEL_STATS else None
        self._measure = ext.measure if ext is not None else None
        self._dense_numel = ext.dense_numel if ext is not None else dense_numel
        # Takes each op record off the cyclic garbage collector's lists as it goes to the writer (native/hotpath.c
        # says why: full collections of the job's whole heap every few steps otherwise); None without the extension.
        self.untrack = native.untrack()
        self._storages = rec.storages  # the recorder's table, for the lookup ref() makes for every tensor
        # its dict and its queue of dead storages (the table changes them in place, never replaces them)
        self._entries, self._dead = rec.storages._entries, rec.storages._dead
        self.max_bytes = rec.options.max_tensor_bytes
        self.verify = rec.options.verify_writes
        self.unseen_writes = 0
        # The tensors of one op whose statistics are computed together when the op ends. Not longer: a reference
        # held past the op changes what torch does next (autograd copies a gradient someone else holds instead of
        # stealing it into .grad; a factory op's output gets an extra detach), so the ops of the job would change.
        self._stat_queue: list[torch.Tensor] = []
        self._stat_refs: dict[tuple, list[dict]] = {}  # tensor key -> the refs waiting for its statistics
        self._stats_seen: dict[tuple, list] = {}
        self._stats_failures: set[str] = set()  # reasons already said (_stats_failed)
        # CPU tensors without the compiled kernel (stats.kernel_stats measures them in ref() where it builds): a flat
        # copy of the values each (taken as the op sees them), measured a batch at a time (stats.values_stats); each
        # ref holds a list (a "cell") filled in place then. Records wait here until their batch is measured, so that
        # the writer never encodes an empty cell.
        self._cpu_pending: list[tuple[list, Any]] = []  # (cell, (values, is_bf16))
        self._cpu_bytes = 0
        self._records: list[dict] = []
        self._flushed_at = time.monotonic()
        self.autograd_versions = False  # set by module granularity (module_stats.py)
        opts = rec.options
        self.budget = DataBudget(opts.budget, bool(opts.modules or opts.ops)) if opts.budget else None
        self.selected = True  # the current op is inside the --module/--op filter
        self.everything = not (opts.modules or opts.ops)  # no filter: every op is inside it
        self.data_off: str | None = None  # why the current op stores no data at all (outside the filter)
        self.left_out: str | None = None  # why some of the current op's data is not stored (marks its record)
        self.refused: str | None = None  # the writer refuses data (a full disk): nothing more is stored
        self._asynchronous: dict[torch.device, bool] = {}  # device -> whether its ops may outlive their call
        self._places: dict[torch.device, tuple[str, bool]] = {}  # device -> (name, asynchronous): _place()
        # Whether a stream may be capturing a graph (an accelerator started): checked at each op only then
        self.capture_possible = seam.RUNTIME.in_use()
        self.capturing = seam.RUNTIME.capture_check()
        self.captured = False  # the placeholders of captured ops were said
        # The accelerator among the current op's inputs (an op on it may still be running when the call returns)
        self.op_device: torch.device | None = None
        # While the outputs of such an op are described: that device, whose work host outputs wait for
        self.late: torch.device | None = None

    # -- tensors ----------------------------------------------------------------------------------------------
    def ref(self, t: torch.Tensor, store: bool) -> dict:
        # This runs for every tensor of every op: each torch read and each Python call here is paid ~2.4 times an
        # op (the selective scan: 6,700 ops a step of a few hundred bytes each). Per dtype and per device what
        # never changes is looked up once (_dtype_facts, _place).
        facts = _DTYPES.get(t.dtype)
        if facts is None:
            facts = _dtype_facts(t.dtype)
        dtype = facts[0]
        device = t.device
        place = self._places.get(device)
        if place is None:
            place = self._place(device)
        dev = place[0]
        if t._is_zerotensor() or type(t) not in _PLAIN or t.layout is not _STRIDED or dev == "meta":
            return self._odd_ref(t, dtype, dev)  # the common tensor passes these with one test
        # Tuples: packed as the lists they would be, and every reader of a record takes tuple() of them. The shape
        # as a plain tuple, not the torch.Size it comes as: the collector stops tracking a tuple of ints (and then
        # the reference holding it) once it has seen it, never a tuple subclass. A record lives until the writer
        # has packed its chunk, long enough to be promoted to the oldest generation: tracked objects there bring
        # on full collections of the whole process (~0.2 s each on the selective scan's step: every few steps).
        shape, stride = tuple(t.shape), t.stride()
        storage = t.untyped_storage()
        # StorageTable.entry's lookup inlined for a storage seen before, unresized, with no deaths queued (most
        # tensors of an op); anything else takes entry() itself.
        # (len() of an untyped storage is its nbytes(), through the type's slot: no method lookup, no arguments)
        entry = None if self._dead else self._entries.get(storage._cdata)
        if entry is None or entry.nbytes != len(storage):
            entry = self._storages.entry(storage)
        asynchronous = place[1]
        if asynchronous:
            self.op_device = device
        if entry.late is not None and self.late is None:
            # bytes a device was copying in, touched by a later op: copied now, before it reads or writes them
            # (the op that started the copy describes its outputs with self.late set: its copy stays pending)
            entry.late.settle()
            entry.late = None
        if entry.crc is not None and crc32(address_view(storage.data_ptr(), entry.nbytes)) != entry.crc:
            # Written since it was stored, behind the dispatcher's back (numpy, a C extension): a new version.
            self._storages.bump(entry)
            self.unseen_writes += 1
        # One call builds the whole reference. Only a complex tensor can carry the conj bit (conj() of a real one
        # is itself): one torch call fewer.
        offset = t.storage_offset()
        ref = schema.wire_stored_tensor(dtype, shape, stride, offset, dev, entry.version, entry.nbytes,
                                        t.requires_grad, entry.uninitialised, facts[3] and t.is_conj(), t.is_neg())
        if not store or self._meta:
            return ref
        if self._full and (self.max_bytes is None or entry.nbytes <= self.max_bytes) and \
                (entry.chunk is not None or self.admit(entry.nbytes, entry)):
            if entry.chunk is None and self.late is not None and not asynchronous:
                entry.chunk, entry.late = self._late_snapshot(storage, t.element_size(), entry.version)
            elif entry.chunk is None:
                entry.chunk = self._snapshot(storage, t.element_size(), entry.version, asynchronous)
                if self.verify and storage.device.type == "cpu":
                    entry.crc = crc32(address_view(storage.data_ptr(), entry.nbytes))
            schema.wire_set_chunk(ref, entry.chunk)
            return ref
        # Statistics. A dense view (view, reshape, t, permute, detach of one) has the statistics of its flat range:
        # one key for all of them, so each storage version is measured once, not once per view. dense_numel says
        # both whether it is dense and how many values (the extension's: one C call).
        n = self._dense_numel(shape, stride)
        is_dense = n >= 0
        if is_dense:
            key: tuple = (entry.version, dtype, offset, n)
        else:
            n = -1 - n
            key = schema.wire_stats_key(ref)
        if self.autograd_versions:
            # No dispatch mode sees writes (module granularity): storage versions never change, so the key
            # also holds the tensor's autograd version counter, which every in-place op bumps. Tensors
            # without one (inference mode) are measured every time.
            try:
                key = (*key, t._version)
            except Exception:
                key = (*key, object())
        if self.late is not None and not asynchronous:
            # the values a device is still copying in: measured once its work has completed
            self._late_stats(ref, t, storage, key)
            return ref
        cached = self._stats_seen.get(key)
        if cached is not None:
            schema.wire_set_stats(ref, cached)
        else:
            self._new_stats(t, ref, key, dev, is_dense, n, offset, entry.nbytes, shape, stride, facts)
        return ref

    def _odd_ref(self, t: torch.Tensor, dtype: str, dev: str) -> dict:
        """The reference of a tensor that is not a plain strided one with storage: a zero tensor (no storage behind
        it, reading its data pointer fails: a marker, no bytes), a meta tensor (geometry is all), a subclass or
        another layout (described as unsupported)."""
        if t._is_zerotensor():
            return schema.wire_zero(schema.wire_tensor(dtype, list(t.shape), list(t.stride()), 0, dev))
        if dev == "meta" and type(t) in _PLAIN and t.layout is _STRIDED:
            return schema.wire_tensor(dtype, list(t.shape), list(t.stride()), t.storage_offset(), dev)
        return schema.wire_unsupported(schema.wire_tensor(dtype, list(t.shape), None, 0, dev),
                                       f"{type(t).__name__}/{t.layout}/{t.device.type}")

    def _place(self, device: torch.device) -> tuple[str, bool]:
        """(name, whether its ops may outlive their call) of a device, once per device and recording: the runtime
        decides (a test's fake one too)."""
        asynchronous = self._asynchronous.get(device)
        if asynchronous is None:
            asynchronous = self._asynchronous[device] = bool(seam.RUNTIME.asynchronous(device))
            if asynchronous and not self.capture_possible:
                self.capture_possible, self.capturing = True, seam.RUNTIME.capture_check()
        place = self._places[device] = (str(device), asynchronous)
        return place

    def _new_stats(self, t: torch.Tensor, ref: dict, key: tuple, dev: str, is_dense: bool, n: int, offset: int,
                   nbytes: int, shape: tuple, stride: tuple, facts: tuple) -> None:
        """The statistics of a tensor whose key has none cached: measured now, or queued for the op's end."""
        if dev == "cpu":
            if (n and (offset + n) * facts[1] > nbytes) if is_dense else \
                    past_storage(n, offset, facts[1], nbytes, is_dense, shape, stride):
                schema.wire_set_stats(ref, None)  # no values to measure: none are read (see past_storage)
                return
            measure = self._measure
            if measure is None:
                s = kernel_stats(t, is_dense, shape, stride)
            elif facts[2] is None:  # a dtype the kernel cannot read
                s = None
            else:
                # Measured now, in place, by the compiled kernel (its extension module: kernel_stats' values, one call)
                s = measure(t.data_ptr(), facts[2], n, None if is_dense else shape, None if is_dense else stride)
                if s == 1:  # NaN or Inf inside, or an overflowing square: numpy's slow path, as kernel_stats
                    s = values_stats([(cpu_values(t, is_dense, copy=False), t.dtype is torch.bfloat16)])[0]
            if s is not None:
                # no copy, and the record waits for no batch
                schema.wire_set_stats(ref, s)
                if len(self._stats_seen) > 100_000:
                    self._stats_seen.clear()
                self._stats_seen[key] = s
                return
            if n * facts[1] > self.LARGE and (values := cpu_values(t, is_dense, copy=False)) is not None:
                # Large: measured in place now rather than copied (no copy; batching gains nothing at this size).
                s = values_stats([(values, t.dtype is torch.bfloat16)])[0]
                schema.wire_set_stats(ref, s)
                self._stats_seen[key] = s
                return
            if (values := cpu_values(t, is_dense)) is not None:
                # A copy now (no torch call, no reference kept past the op); the statistics later, in a batch.
                cell: list = []
                schema.wire_set_stats(ref, cell)
                if len(self._stats_seen) > 100_000:
                    self._stats_seen.clear()
                self._stats_seen[key] = cell
                self._cpu_pending.append((cell, (values, t.dtype is torch.bfloat16)))
                self._cpu_bytes += values.nbytes
                return
        if key in self._stat_refs:
            self._stat_refs[key].append(ref)
        else:
            self._stat_refs[key] = [ref]
            self._stat_queue.append(t)

    def admit(self, nbytes: int, entry: Any = None) -> bool:
        """Whether bytes not stored yet may be (the filter, the budget, a full disk); when not, the op is marked and
        the storage's bytes counted as left out (once per storage version)."""
        why = self.data_off or self.refused
        if why is None:
            if self.budget is None or self.budget.admit(nbytes, self.selected, self.rec.writer.records_bytes):
                if entry is not None and entry.left_out is not None:  # left out at an earlier op, stored now
                    self.rec.writer.left_out.add_bytes(entry.left_out, -entry.nbytes)
                    entry.left_out = None
                return True
            why = schema.LEFT_OUT_BUDGET
        self.left_out = why
        if entry is not None and entry.left_out is None:
            entry.left_out = why
            self.rec.writer.left_out.add_bytes(why, nbytes)
        return False

    def notice_refusal(self) -> None:
        """The writer stopped taking data (a full disk): store nothing more, and forget what went to data files
        that will never be written."""
        self.refused = self.rec.writer.data_refused
        first = self.rec.writer.data_lost_from
        if first is not None:
            self.rec.storages.forget_chunks_from(first)

    def _late_snapshot(self, storage: torch.UntypedStorage, itemsize: int, version: int) -> tuple[int, "LateCopy"]:
        """A host storage an accelerator is writing (``x.to("cpu", non_blocking=True)``, ``buf.copy_(gpu,
        non_blocking=True)``): its bytes exist once the work queued so far on that device's stream has completed.
        An event marks that point; the writer copies the bytes once the event has completed, or the recording
        thread does, earlier, when an op touches the storage (the job has waited for the copy before then, or
        reads a storage that is still being written, as the record then shows)."""
        staging = self.rec.writer.staging
        n = storage.nbytes()
        slot = staging.take(n)
        try:
            with _disable_current_modes():
                event = seam.RUNTIME.record_event(self.late)
        except BaseException:
            staging.release(slot)
            raise
        late = LateCopy(storage, slot.view, event)
        return self.rec.writer.add_snapshot(Snapshot(version, slot.view, itemsize, late, slot=slot)), late

    def _late_stats(self, ref: dict, t: torch.Tensor, storage: torch.UntypedStorage, key: Any) -> None:
        """Statistics of a host tensor an accelerator is writing: measured by the writer thread once the event
        after the op has completed (from the storage, which the closure keeps alive; the tensor itself is not kept,
        see ``_stat_queue``)."""
        cell: list = []
        schema.wire_set_stats(ref, cell)
        self._stats_seen.pop(key, None)
        with _disable_current_modes():
            event = seam.RUNTIME.record_event(self.late)
        geometry = (t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        self.rec.writer.defer(lambda timeout: _fill_late_stats(cell, event, storage, geometry, timeout))

    def _snapshot(self, storage: torch.UntypedStorage, itemsize: int, version: int, asynchronous: bool) -> int:
        """Store a storage's bytes: ``asynchronous``, copied from its device in its stream's order."""
        if not asynchronous:
            return self.rec.writer.add_snapshot(self._copy(storage, itemsize, version, False))
        with _disable_current_modes():  # modes below us (a planted fault, a debug mode) never see our copies
            snap = self._copy(storage, itemsize, version, True)
        return self.rec.writer.add_snapshot(snap)

    def _copy(self, storage: torch.UntypedStorage, itemsize: int, version: int, asynchronous: bool) -> Snapshot:
        # The writer's staging memory: outside the job's heap, bounded in bytes (waits for the writer when full).
        staging = self.rec.writer.staging
        n = storage.nbytes()
        if not asynchronous:
            # A plain memcpy: no torch op, so nothing to dispatch and no mode to step around (3-9 us instead of
            # 18-30 us for the storages of a small model).
            slot = staging.take(n)
            if n:
                ctypes.memmove(slot.address, storage.data_ptr(), n)
            return Snapshot(version, slot.view, itemsize, slot=slot)
        # Ordered after the op on the current stream, asynchronous into pinned memory: the GPU is not stalled.
        # torch's pinned allocator rounds a block up to a power of two: that is what the staging bound counts.
        runtime = seam.RUNTIME
        slot = staging.reserve(_pinned_size(n))
        try:
            u8 = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host = runtime.pinned(n)
            host.copy_(u8, non_blocking=True)
            event = runtime.record_event(storage.device)
        except BaseException:
            staging.release(slot)
            raise
        return Snapshot(version, host, itemsize, seam.Arrival(event), slot=slot)

    def flush_stats(self) -> None:
        """Measure the queued tensors into their refs. Never raises: the queue is taken before anything is computed
        (a failure cannot leave it to fail again at every later op), and what could not be measured is recorded
        without statistics, the reason said once (``_stats_failed``)."""
        if not self._stat_queue:
            return
        queue, pending = self._stat_queue, self._stat_refs
        self._stat_queue, self._stat_refs = [], {}
        failures: list[str] = []
        try:
            defer = getattr(self.rec.writer, "defer", None)
            if defer is not None and any(self._asynchronous.get(t.device) for t in queue):
                self._defer_device_stats(defer, queue, pending, failures)
            else:
                with _disable_current_modes():
                    stats = batch_stats(queue, failures)
                for (key, refs), s in zip(pending.items(), stats):
                    for ref in refs:
                        schema.wire_set_stats(ref, s)
                    self._stats_seen[key] = s
        except Exception as exc:
            for key, refs in pending.items():
                for ref in refs:
                    schema.wire_set_stats(ref, None)
                self._stats_seen.pop(key, None)
            failures.append(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
        if failures:
            self._stats_failed(failures)
        if len(self._stats_seen) > 100_000:
            self._stats_seen.clear()

    def _stats_failed(self, failures: list[str]) -> None:
        """Tensors recorded without statistics because torch could not reduce them: said once per reason, in the
        trace and as the recorder's warning; the op records stand, the job goes on."""
        for why in failures:
            if why in self._stats_failures:
                continue
            self._stats_failures.add(why)
            if len(self._stats_failures) > 20:
                return
            line = (f"statistics of some tensors could not be computed ({why}); they are recorded without "
                    f"statistics (op #{self.rec.next_index - 1} on)")
            try:
                self.rec.writer.note_lost(line)
                if len(self._stats_failures) == 1:
                    self.rec.warn(line)
            except Exception:  # a closed writer or stderr: the records say it by their missing statistics
                pass

    def _defer_device_stats(self, defer: Any, queue: list[torch.Tensor], pending: dict, failures: list[str]) -> None:
        """Statistics of device tensors without a synchronisation: reduced on their device, copied to the host
        asynchronously (``stats.DeviceStats``), and written into each ref's cell by the writer thread before it
        encodes the chunk (``RankWriter.defer``). Reading them here (``.tolist()``) would stall the job's stream at
        every op. Tensors without statistics and tensors off any device keep the synchronous path."""
        measured, cells = [], []
        host, host_keys = [], []
        for t, (key, refs) in zip(queue, pending.items()):
            if not has_stats(t):
                for ref in refs:
                    schema.wire_set_stats(ref, None)
                self._stats_seen[key] = None
            elif not self._asynchronous.get(t.device):
                host.append(t)
                host_keys.append((key, refs))
            else:
                cell: list = []
                for ref in refs:
                    schema.wire_set_stats(ref, cell)
                self._stats_seen[key] = cell
                measured.append(t)
                cells.append(cell)
        with _disable_current_modes():
            if host:
                for (key, refs), s in zip(host_keys, batch_stats(host, failures)):
                    for ref in refs:
                        schema.wire_set_stats(ref, s)
                    self._stats_seen[key] = s
            batch = DeviceStats(measured) if measured else None
        if batch is not None:
            defer(lambda timeout: _fill_device_cells(batch, cells, timeout))
        if len(self._stats_seen) > 100_000:
            self._stats_seen.clear()

    def forget_stats(self) -> None:
        """Drop cached statistics: the bytes behind a storage version may have changed unseen (between steps)."""
        self._stats_seen.clear()

    # -- records: held until their CPU statistics are computed, a batch at a time ---------------------------------
    LARGE = 256 << 10  # bytes of a tensor measured in place right away instead of copied for the batch
    BATCH_OPS = 128
    BATCH_BYTES = 8 << 20

    def add_op(self, record: dict) -> None:
        """Hand a record on, in op order; it reaches the writer with its statistics at the next batch."""
        if self._stat_queue:
            self.flush_stats()
        if not self._cpu_pending and not self._records:  # nothing to wait for (full, meta): straight through
            self.rec.writer.add_op(record)
            return
        self._records.append(record)
        if len(self._records) >= self.BATCH_OPS or self._cpu_bytes >= self.BATCH_BYTES \
                or time.monotonic() - self._flushed_at >= self.rec.options.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Compute the waiting statistics and give every waiting record to the writer."""
        self.flush_stats()
        if self._cpu_pending:
            # Here, not on the writer thread: measured, a writer thread doing numpy work holds the GIL in slices
            # that stall the job's thread longer than doing the work here.
            _fill_cells(self._cpu_pending)
            self._cpu_pending, self._cpu_bytes = [], 0
        records, self._records = self._records, []
        self._flushed_at = time.monotonic()
        for record in records:
            self.rec.writer.add_op(record)

    def encode(self, v: Any, store: bool = True) -> Any:
        """``schema.encode_value`` of an argument or output, the same value, faster for what aten ops take and
        return: a plain tensor, a list or tuple of them, numbers. Anything else goes to ``encode_value`` itself."""
        cls = type(v)
        if cls in _PLAIN:
            return self.ref(v, store)
        if cls is list or cls is tuple:
            return self.encode_list(v, store)
        return schema.encode_value(v, lambda t: self.ref(t, store))

    def encode_list(self, vs: list | tuple, store: bool = True) -> list:
        """``[encode(v) for v in vs]`` in one loop: no call per plain tensor's neighbour (ints, floats, None)."""
        out = []
        ref = self.ref
        for v in vs:
            cls = type(v)
            if cls in _PLAIN:
                out.append(ref(v, store))
            elif cls in _VERBATIM or (cls is int and _INT_MIN <= v < _INT_END):
                out.append(v)  # as encode_value keeps them (bool before int there; both verbatim here)
            elif cls is list or cls is tuple:
                out.append(self.encode_list(v, store))
            else:
                out.append(schema.encode_value(v, lambda t: ref(t, store)))
        return out


def _fill_cells(pending: list[tuple[list, Any]]) -> None:
    """Fill the statistics cells of a batch of CPU tensor copies (every ref of a tensor holds its cell)."""
    stats = values_stats([v for _, v in pending])
    for (cell, _), st in zip(pending, stats):
        cell[:] = st


def _fill_device_cells(batch: DeviceStats, cells: list[list], timeout: float) -> bool:
    """Writer thread: wait up to ``timeout`` for the batch's host copy (its event, not the stream) and fill each
    cell in place; whether it did. Cells never filled stay empty (a hung kernel ahead of the copy): those tensors
    are recorded without statistics, and the records go on."""
    if not batch.wait(timeout):
        return False
    for cell, st in zip(cells, batch.result()):
        cell[:] = st if st is not None else []
    return True


def _pinned_size(n: int) -> int:
    return 1 << max(0, n - 1).bit_length() if n else 0


class LateCopy:
    """The bytes of a host storage an accelerator is writing, copied once they have landed: by the writer thread
    once the device's event has completed (``wait``), or by the recording thread when an op touches the storage
    first (``settle``). Given up (``abandon``), it never writes into its staging memory again."""

    __slots__ = ("storage", "view", "event", "done", "_lock")

    def __init__(self, storage: torch.UntypedStorage, view: memoryview, event: Any) -> None:
        self.storage: torch.UntypedStorage | None = storage
        self.view = view
        self.event = event
        self.done = False
        self._lock = threading.Lock()

    def settle(self) -> None:
        with self._lock:
            if self.done or self.storage is None:
                return
            n = len(self.view)
            if n:
                ctypes.memmove((ctypes.c_char * n).from_buffer(self.view), self.storage.data_ptr(), n)
            self.done = True
            self.storage = None

    def wait(self, timeout: float) -> bool:
        if not self.done and not seam.wait(self.event, timeout):
            return False
        self.settle()
        return self.done

    def abandon(self) -> None:
        with self._lock:
            self.storage = None


def _fill_late_stats(cell: list, event: Any, storage: torch.UntypedStorage, geometry: tuple, timeout: float) -> bool:
    """Writer thread: the statistics of a host tensor once the device's copy into it has landed, waiting up to
    ``timeout``; whether it has (never: the cell stays empty, and the record says nothing rather than something
    false)."""
    if not seam.wait(event, timeout):
        return False
    dtype, offset, shape, stride = geometry
    t = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
    cell[:] = (batch_stats([t])[0] or [])
    return True


def select(b: OpBuilder, opts: Any, name: str, module: str | None) -> None:
    """Whether the op (or compiled unit) about to be recorded is inside the --module/--op filter. Outside it: recorded
    with statistics (replay then says where a difference came in), data only from what a budget leaves for such ops."""
    if b.everything:  # no filter: selected and data_off stay as __init__ set them (nothing else changes them)
        b.left_out = None
        return
    b.selected = opts.selects(name, module)
    b.data_off = b.left_out = None if b.selected or b.budget is not None else schema.LEFT_OUT_FILTERED


# id(op overload) -> (the overload, its OpFacts, its name, whether it needs the rarer parts of record_before: a custom
# op, a written argument, a collective, a generator draw). By id: an OpOverload's __hash__ is Python code; the
# overload is kept, so its id is never another object's while the entry exists.
_OPS: dict[int, tuple[Any, Any, str, bool]] = {}


def _op(func: Any) -> tuple[Any, Any, str, bool]:
    info = aten.facts(func)
    entry = _OPS[id(func)] = (func, info, info.name,
                              bool(info.module is not None or info.writes or info.collective or info.seeded))
    return entry


# What record_before hands record_after (a tuple: an object with slots cost ~0.25 us an op to make): the record,
# the written arguments, whether the outputs are uninitialised memory (empty*), whether the op is a collective.
Pending = tuple
_NOTHING_WRITTEN: list = []  # shared, never appended to: the written arguments of most ops


def record_before(rec: RecorderLike, b: OpBuilder, func: Any, types: Any, args: tuple,
                  kwargs: dict) -> Pending | None:
    index = rec.next_index
    rec.next_index = index + 1
    op = _OPS.get(id(func))
    if op is None or op[0] is not func:
        op = _op(func)
    _, info, name, rare = op
    if b.capture_possible:
        if b.capturing():
            seam.hold_queries(True)  # no thread may query an event now (the writer's waits sleep instead)
            _captured(rec, b, index, name, info, args, kwargs)
            return None
        if seam.queries_held():
            seam.hold_queries(False)
    b.op_device = None
    written = _NOTHING_WRITTEN
    if rare:
        if info.module is not None and name not in rec.custom_ops:
            rec.custom_ops[name] = info.module
        if info.writes:
            written = written_args(info, args, kwargs)
    ctx = rec.context
    phase, module, fwd, rc = ctx.place(index, name)
    if b.refused is None and rec.writer.data_refused is not None:
        b.notice_refusal()
    if b.everything:  # select(): no filter, nothing else to decide
        b.left_out = None
    else:
        select(b, rec.options, name, module)
    where = ctx.source()
    called = None
    if fwd is not None or rc is not None or (where is None and phase == "backward"):
        where, called = ctx.backward_source(where, rc)
    if where is not None:
        record = schema.wire_op(index, name, phase, module, fwd, where[0], where[1])
    else:
        record = schema.wire_op(index, name, phase, module, fwd, None, None)
    if rc is not None:
        schema.wire_set_recompute(record, rc.of, called)
    if rec.step is not None:
        schema.wire_set_step(record, rec.step)
    if rare:
        if info.collective:
            coll = collective_info(func, args, kwargs)
            schema.wire_set_collective(record, coll)
            if not aten.is_wait_only(name):
                rec.writer.enter_collective(schema.wire_entered(index, name, phase, module,
                                                                where[0] if where is not None else None, coll))
        if info.seeded and b._full and b.data_off is None:  # generator state is data: "full" traces only
            state = rec.rng_state(args, kwargs)
            if state is not None:
                schema.wire_set_rng(record, *state)
    # Arguments the op writes are described as they are now, before the op.
    schema.wire_set_inputs(record, b.encode_list(args), {k: b.encode(v) for k, v in kwargs.items()} if kwargs else {})
    # Inputs the op will write get their statistics now, as they are before it.
    if written:
        b.flush_stats()
    return record, written, info.uninitialised, info.collective


def record_after(rec: RecorderLike, b: OpBuilder, p: Pending, func: Any, args: tuple, kwargs: dict,
                 out: Any) -> Any:
    """Record what the op made; returns ``out`` for the job (a point-to-point work replaced by a completed one)."""
    record, written, uninitialised, collective = p
    returned = out
    if collective:
        out = returned = wait_collective(func, out, args, kwargs, b.op_device is not None)
        if b.op_device is not None:
            # Issued, not done: the device runs it. The writer keeps its marker until this event completes, so a
            # collective that never does is named by a rank killed while waiting for it.
            try:
                with _disable_current_modes():
                    rec.writer.leave_collective(seam.RUNTIME.record_event(b.op_device))
            except Exception:
                rec.writer.leave_collective()
        else:
            rec.writer.leave_collective()
    try:  # the job gets ``returned`` whatever happens to the record
        if written:
            for _, v in written:
                for t in iter_tensors(v):
                    e = rec.storages.entry(t.untyped_storage())
                    rec.storages.bump(e)
        # Host outputs of an op on an accelerator (a non-blocking copy to the CPU) are read once the device is done
        b.late = b.op_device
        try:
            if uninitialised:
                for t in iter_tensors(out):
                    rec.storages.entry(t.untyped_storage()).uninitialised = True
                schema.wire_set_outputs(record, b.encode(out, store=False), None, True)
            else:
                writes = [(path, b.encode(v)) for path, v in written] if written else None
                schema.wire_set_outputs(record, b.ref(out, True) if type(out) in _PLAIN else b.encode(out), writes,
                                        False)
        finally:
            b.late = None
        if b.left_out is not None:
            schema.wire_set_left_out(record, b.left_out)
        if b.untrack is not None:  # off the cyclic collector's lists before it waits for the writer: hotpath.c
            b.untrack(record)
        if b._stat_queue or b._cpu_pending or b._records:  # add_op(), where it has more to do than hand it on
            b.add_op(record)
        else:
            rec.writer.add_op(record)
    except Exception as exc:
        rec.op_failed(func, args, kwargs, exc)
    return returned


CAPTURED = ("under graph capture: a captured op runs later, when the graph is replayed, and reading its tensors "
            "now would break the capture")


def _captured(rec: RecorderLike, b: OpBuilder, index: int, name: str, info: Any, args: tuple, kwargs: dict) -> None:
    """An op issued while a stream captures a graph: it runs later, at each replay of the graph. A placeholder with
    the reason stands for it; nothing is read, copied, recorded on the stream or drawn from a generator (any of
    those would invalidate the capture), and what it writes gets new storage versions. Said once."""
    stub = schema.wire_op(index, name, None, None, None, None)
    if rec.step is not None:
        schema.wire_set_step(stub, rec.step)
    b.add_op(schema.wire_not_recorded(stub, CAPTURED))
    if info.writes:
        for _, v in written_args(info, args, kwargs):
            for t in iter_tensors(v):
                rec.storages.bump(rec.storages.entry(t.untyped_storage()))
    if not b.captured:
        b.captured = True
        rec.writer.note_lost(f"ops from #{index} on were issued under graph capture and are recorded as "
                             f"placeholders (they run when the graph is replayed)")
        rec.warn(f"op #{index} {name} and those after it under graph capture are recorded as placeholders: a "
                 f"captured op runs when the graph is replayed")


def _reduce_op_name(obj: Any) -> str | None:
    try:
        from torch.distributed import ReduceOp

        code = obj.op()  # the custom class exposes only op(): RedOpType's value
        for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
            if getattr(ReduceOp, name).value == code:
                return name.lower()
    except Exception:
        pass
    return None


def _group_info(pg: Any) -> dict:
    import torch.distributed as dist

    name = getattr(pg, "group_name", None)
    return {"ranks": dist.get_process_group_ranks(pg), "size": pg.size(), "group_rank": pg.rank(),
            "group_name": name if isinstance(name, str) else None}


def collective_info(func: Any, args: tuple, kwargs: dict) -> CollectiveInfo:
    """Group name, ranks and size, reduce op and root of a collective, read through its schema's argument names.

    What cannot be read stays unknown (a reduce op becomes "unknown", never a guess) and is listed in problems."""
    group: dict[str, Any] = {}
    reduce_op: str | None = None
    root: int | None = None
    extras: dict[str, Any] = {}
    problems: list[str] = []
    for i, a in enumerate(func._schema.arguments):
        v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        if v is None:
            continue
        typ = str(a.type)
        try:
            if "ProcessGroup" in typ:
                group = _group_info(torch._C._distributed_c10d.ProcessGroup.unbox(v))
            elif "ReduceOp" in typ:
                reduce_op = _reduce_op_name(v) or "unknown"
            elif a.name in ("reduceOp", "reduce_op") and isinstance(v, str):
                reduce_op = v.lower()
            elif a.name in ("group_name", "tag") and isinstance(v, str) and not group:
                from torch.distributed.distributed_c10d import _resolve_process_group

                group = _group_info(_resolve_process_group(v))
            elif a.name in ("root_rank", "src", "root", "group_src") and isinstance(v, int):
                root = v
            elif a.name == "group_size" and isinstance(v, int):
                extras[a.name] = v
        except Exception as exc:
            problems.append(f"{a.name}: {type(exc).__name__}")
            if "ReduceOp" in typ or a.name in ("reduceOp", "reduce_op"):
                reduce_op = "unknown"
    return CollectiveInfo(ranks=tuple(group.get("ranks", ())), size=group.get("size"),
                          group_rank=group.get("group_rank"), group_name=group.get("group_name"),
                          reduce_op=reduce_op, root=root, extras=extras, problems=tuple(problems))


# recv_any_source_'s work names the sender (dist.recv(src=None) asks it): it is left to the job, not waited here.
_NOT_WAITED = frozenset({"recv_any_source_"})


def _completed_work(work: Any) -> Any:
    """A work that is already complete, standing for ``work`` (waited): the job's own wait() returns at once."""
    try:
        from torch._C._distributed_c10d import _create_work_from_future

        done = torch.futures.Future()
        done.set_result(None)
        work_done = _create_work_from_future(done)
        return work_done.boxed()  # as the dispatcher hands works over (a script object)
    except Exception:  # no such constructor in this torch: the job waits on the original (gloo may then hang)
        return work


def _counts_waits(func: Any, args: tuple, kwargs: dict, on_device: bool) -> bool:
    """Whether a point-to-point work must be handed to the job complete: gloo's send and receive wait for one more
    transfer each time they are waited on. NCCL's (any device backend's) can be waited again, from another stream
    too, which a completed stand-in would drop. A group whose backend cannot be read: by where its tensors are."""
    for i, a in enumerate(func._schema.arguments):
        if "ProcessGroup" in str(a.type):
            v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            try:
                return torch._C._distributed_c10d.ProcessGroup.unbox(v)._get_backend_name() == "gloo"
            except Exception:
                break
    return not on_device


def wait_collective(func: Any, out: Any, args: tuple = (), kwargs: dict | None = None, on_device: bool = False) -> Any:
    """Outputs of a collective exist only once its work completes: wait for it (the job would, before using them).

    On an accelerator (NCCL) waiting orders the current stream after the collective and returns at once; the
    outputs are then read in stream order, after the data has arrived. A point-to-point work stays the job's own
    there (``_counts_waits``)."""
    if func.namespace == "c10d":
        packet = func._opname
        if packet in _NOT_WAITED:
            return out
        # (tensors, Work) from most; a bare Work from alltoall_base_, reduce_, gather_, send, recv_ and the coalesced
        # forms
        for v in (out if isinstance(out, (tuple, list)) else (out,)):
            if hasattr(v, "wait") and not isinstance(v, torch.Tensor):
                v.wait()
        # Point-to-point works count their waits (gloo's send and receive wait for one more transfer each time they
        # are waited on): waited here, the job gets a work already complete, or its own wait() would hang.
        if packet in aten.POINT_TO_POINT_PACKETS and not isinstance(out, (tuple, list)) and \
                _counts_waits(func, args, kwargs or {}, on_device):
            return _completed_work(out)
    elif func.namespace in ("_c10d_functional", "c10d_functional"):
        for t in iter_tensors(out):
            torch.ops._c10d_functional.wait_tensor(t)
    return out
