"""The private dispatch mode that turns every aten op into an op record.

For each op: inputs are described (and their bytes snapshotted once per storage version) *before* the op runs, so
in-place and out= ops keep what they read; the op runs exactly as it would have; outputs and every argument the
schema marks written are described *after* it. Any exception inside the bookkeeping disables recording with one
warning and is never raised into the job; the op itself always runs unchanged.
"""
from __future__ import annotations

import ctypes
import fnmatch
import zlib
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from replaydiff.record.context import BACKWARD, FORWARD
from replaydiff.record.encode import TENSOR_KEY, encode_value
from replaydiff.record.stats import batch_stats
from replaydiff.trace.codec import address_view, buffer_address
from replaydiff.trace.writer import Snapshot

if TYPE_CHECKING:
    from replaydiff.record.recorder import Recorder

log = logging.getLogger("replaydiff")

_UNINITIALISED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_dtensor"}
_SEEDED = torch.Tag.nondeterministic_seeded
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_DEVICE_NAMES: dict[torch.device, str] = {}
_DTYPE_NAMES: dict[torch.dtype, str] = {}


class OpInfo:
    """What the recorder needs to know of an op overload, worked out once per overload rather than once per call."""

    __slots__ = ("name", "collective", "seeded", "uninitialised", "writes")

    def __init__(self, func: Any) -> None:
        self.name = str(func)
        self.collective = func.namespace in _COLLECTIVE_NAMESPACES
        self.seeded = _SEEDED in func.tags
        self.uninitialised = func.overloadpacket.__name__ in _UNINITIALISED
        # (position, name, kwarg_only) of each argument the op writes: schema-marked writes, and every argument of a
        # collective (their schemas mark nothing written)
        self.writes = tuple((i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
                            if self.collective or (a.alias_info is not None and a.alias_info.is_write))


_INFO: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = OpInfo(func)
    return info


def written_args(info: OpInfo, args: tuple, kwargs: dict) -> list[tuple[list, Any]]:
    """(path, value) of each argument the op writes that holds a tensor."""
    out = []
    for i, name, kwarg_only in info.writes:
        if i < len(args) and not kwarg_only:
            path, v = ["a", i], args[i]
        elif name in kwargs:
            path, v = ["k", name], kwargs[name]
        else:
            continue
        if any(True for _ in iter_tensors(v)):  # a tensor, or a (nested) list holding one: allgather's list of lists
            out.append((path, v))
    return out


def iter_tensors(v: Any):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from iter_tensors(x)


class RecordingMode(TorchDispatchMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.rec = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if not rec.active:
            return func(*args, **kwargs)
        pending = None
        try:
            pending = rec.before(func, types, args, kwargs)
        except Exception as exc:
            rec.disable(f"an op could not be recorded ({func}: {type(exc).__name__}: {exc})")
        out = func(*args, **kwargs)
        if pending is not None:
            try:
                rec.after(pending, func, args, kwargs, out)
            except Exception as exc:
                rec.disable(f"an op could not be recorded ({func}: {type(exc).__name__}: {exc})")
        return out


class OpBuilder:
    """The per-op half of the recorder: describes tensors, snapshots storages, builds records."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.mode = rec.options.tensors
        self.max_bytes = rec.options.max_tensor_bytes
        self.verify = rec.options.verify_writes
        self.unseen_writes = 0
        # The tensors of one op whose statistics are computed together when the op ends. Not longer: a reference
        # held past the op changes what torch does next (autograd copies a gradient someone else holds instead of
        # stealing it into .grad; a factory op's output gets an extra detach), so the ops of the job would change.
        self._stat_queue: list[torch.Tensor] = []
        self._stat_refs: dict[tuple, list[dict]] = {}  # tensor key -> the refs waiting for its statistics
        self._stats_seen: dict[tuple, list] = {}

    # -- tensors ----------------------------------------------------------------------------------------------
    def ref(self, t: torch.Tensor, store: bool) -> dict:
        device = t.device
        dev = _DEVICE_NAMES.get(device)
        if dev is None:
            dev = _DEVICE_NAMES[device] = str(device)
        dtype = _DTYPE_NAMES.get(t.dtype)
        if dtype is None:
            dtype = _DTYPE_NAMES[t.dtype] = str(t.dtype).removeprefix("torch.")
        if type(t) not in _PLAIN or t.layout is not torch.strided or dev == "meta":
            return {"dt": dtype, "sh": list(t.shape), "st": None, "of": 0, "dev": dev, TENSOR_KEY: None,
                    "unsupported": f"{type(t).__name__}/{t.layout}/{device.type}"}
        ref: dict[str, Any] = {"dt": dtype, "sh": list(t.shape), "st": list(t.stride()), "of": t.storage_offset(),
                               "dev": dev}
        if t.requires_grad:
            ref["rg"] = True
        storage = t.untyped_storage()
        entry = self.rec.storages.entry(storage)
        if entry.crc is not None and zlib.crc32(address_view(storage.data_ptr(), entry.nbytes)) != entry.crc:
            # Written since it was stored, behind the dispatcher's back (numpy, a C extension): a new version.
            self.rec.storages.bump(entry)
            self.unseen_writes += 1
        ref[TENSOR_KEY] = entry.version
        ref["sb"] = entry.nbytes
        if entry.uninitialised:
            ref["u"] = True
        if not store:
            return ref
        if self.mode == "full" and (self.max_bytes is None or entry.nbytes <= self.max_bytes):
            if entry.chunk is None:
                entry.chunk = self._snapshot(storage, t.element_size(), entry.version)
                if self.verify and storage.device.type == "cpu":
                    entry.crc = zlib.crc32(address_view(storage.data_ptr(), entry.nbytes))
            ref["f"] = entry.chunk
        elif self.mode != "meta":
            key = (entry.version, ref["dt"], tuple(ref["sh"]), tuple(ref["st"]), ref["of"])
            cached = self._stats_seen.get(key)
            if cached is not None:
                ref["s"] = cached
            elif key in self._stat_refs:
                self._stat_refs[key].append(ref)
            else:
                self._stat_refs[key] = [ref]
                self._stat_queue.append(t)
        return ref

    def _snapshot(self, storage: torch.UntypedStorage, itemsize: int, version: int) -> int:
        if storage.device.type == "cpu":
            return self.rec.writer.add_snapshot(self._copy(storage, itemsize, version))
        with _disable_current_modes():  # modes below us (a planted fault, a debug mode) never see our copies
            snap = self._copy(storage, itemsize, version)
        return self.rec.writer.add_snapshot(snap)

    @staticmethod
    def _copy(storage: torch.UntypedStorage, itemsize: int, version: int) -> Snapshot:
        if storage.device.type == "cpu":
            # A plain memcpy into a Python buffer: no torch op, so nothing to dispatch and no mode to step around
            # (3-9 us instead of 18-30 us for the storages of a small model).
            n = storage.nbytes()
            buf = bytearray(n)
            if n:
                ctypes.memmove(buffer_address(buf), storage.data_ptr(), n)
            return Snapshot(version, buf, itemsize)
        # Ordered after the op on the current stream, asynchronous into pinned memory: the GPU is not stalled.
        u8 = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        host = torch.empty(u8.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(u8, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(storage.device))
        return Snapshot(version, host, itemsize, event)

    def flush_stats(self) -> None:
        if not self._stat_queue:
            return
        with _disable_current_modes():
            stats = batch_stats(self._stat_queue)
        for (key, refs), s in zip(self._stat_refs.items(), stats):
            for ref in refs:
                ref["s"] = s
            self._stats_seen[key] = s
        self._stat_queue, self._stat_refs = [], {}
        if len(self._stats_seen) > 100_000:
            self._stats_seen.clear()

    def encode(self, v: Any, store: bool = True) -> Any:
        return encode_value(v, lambda t: self.ref(t, store))


class Pending:
    __slots__ = ("record", "written", "uninitialised")

    def __init__(self, record: dict | None, written: list, uninitialised: bool) -> None:
        self.record = record
        self.written = written
        self.uninitialised = uninitialised


def op_matches(name: str, module: str | None, op_globs: list[str] | None, module_globs: list[str] | None) -> bool:
    if op_globs and not any(fnmatch.fnmatchcase(name, g) for g in op_globs):
        return False
    if module_globs and not (module and any(fnmatch.fnmatchcase(module, g) for g in module_globs)):
        return False
    return True


def record_before(rec: Recorder, b: OpBuilder, func: Any, types: Any, args: tuple, kwargs: dict) -> Pending | None:
    index = rec.next_index
    rec.next_index += 1
    info = op_info(func)
    name = info.name
    ctx = rec.context
    phase, seq = ctx.phase()
    module = ctx.module()
    fwd = None
    if phase == FORWARD:
        ctx.note_forward(index, module)
    elif phase == BACKWARD:
        fwd = ctx.forward_of(seq)
        if fwd is not None:
            # A backward op belongs to the module of the forward op that made its autograd node. ModuleTracker
            # alone cannot tell sibling modules apart in backward (it never leaves a module whose inputs need
            # no grad, e.g. two embeddings, and picks one of them at random).
            module = ctx.forward_module(seq)
    written = written_args(info, args, kwargs) if info.writes else []
    if not op_matches(name, module, rec.options.ops, rec.options.modules):
        # Not stored, but what it writes still makes new storage versions: a later stored op must not be given
        # the bytes from before this write.
        return Pending(None, written, info.uninitialised) if written or info.uninitialised else None
    record: dict[str, Any] = {"i": index, "op": name, "ph": phase}
    if module:
        record["mod"] = module
    if fwd is not None:
        record["fwd"] = fwd
    src = ctx.source()
    if src:
        record["src"] = src
    if info.collective:
        record["coll"] = collective_info(func, args, kwargs)
    if info.seeded and b.mode == "full":  # generator state is data: only "full" traces store any
        record["rng"] = rec.rng_state(args, kwargs)
    # Arguments the op writes are described as they are now, before the op.
    record["a"] = b.encode(list(args))
    record["k"] = {k: b.encode(v) for k, v in kwargs.items()}
    # Inputs the op will write get their statistics now, as they are before it.
    if written:
        b.flush_stats()
    return Pending(record, written, info.uninitialised)


def record_after(rec: Recorder, b: OpBuilder, p: Pending, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    record = p.record
    if record is not None and "coll" in record:
        out = wait_collective(func, out)
    for _, v in p.written:
        for t in iter_tensors(v):
            e = rec.storages.entry(t.untyped_storage())
            rec.storages.bump(e)
    if p.uninitialised:
        for t in iter_tensors(out):
            rec.storages.entry(t.untyped_storage()).uninitialised = True
    if record is None:  # filtered out: only its writes mattered
        return
    if p.uninitialised:
        record["u"] = True
        record["o"] = b.encode(out, store=False)
    else:
        if p.written:
            record["w"] = [[path, b.encode(v)] for path, v in p.written]
        record["o"] = b.encode(out)
    b.flush_stats()
    rec.writer.add_op(record)


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

    return {"ranks": dist.get_process_group_ranks(pg), "size": pg.size(), "group_rank": pg.rank()}


def collective_info(func: Any, args: tuple, kwargs: dict) -> dict:
    """Group ranks and size, reduce op and root of a collective, read through its schema's argument names."""
    info: dict[str, Any] = {}
    for i, a in enumerate(func._schema.arguments):
        v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        if v is None:
            continue
        typ = str(a.type)
        try:
            if "ProcessGroup" in typ:
                info.update(_group_info(torch._C._distributed_c10d.ProcessGroup.unbox(v)))
            elif "ReduceOp" in typ:
                info["reduce_op"] = _reduce_op_name(v)
            elif a.name in ("reduceOp", "reduce_op") and isinstance(v, str):
                info["reduce_op"] = v.lower()
            elif a.name in ("group_name", "tag") and isinstance(v, str) and "ranks" not in info:
                from torch.distributed.distributed_c10d import _resolve_process_group

                info.update(_group_info(_resolve_process_group(v)))
            elif a.name in ("root_rank", "src", "root", "group_size", "group_src") and isinstance(v, int):
                info[a.name] = v
        except Exception as exc:
            info.setdefault("problems", []).append(f"{a.name}: {type(exc).__name__}")
    return info


def wait_collective(func: Any, out: Any) -> Any:
    """Outputs of a collective exist only once its work completes: wait for it (the job would, before using them)."""
    if func.namespace == "c10d" and isinstance(out, (tuple, list)):
        for v in out:
            if hasattr(v, "wait") and not isinstance(v, torch.Tensor):
                v.wait()
    elif func.namespace in ("_c10d_functional", "c10d_functional"):
        for t in iter_tensors(out):
            torch.ops._c10d_functional.wait_tensor(t)
    return out
