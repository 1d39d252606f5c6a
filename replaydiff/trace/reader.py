"""Reading a trace lazily: the manifest at open, one ops chunk and one storage at a time on demand.

``open_trace(path)`` gives a ``Trace``; ``trace.rank(r)`` a ``RankTrace``, a sequence of typed ``OpRecord`` numbered
from 0, with the stored tensors (``tensor(ref)``), the index (``index``, ``producers``, ``consumers``,
``modules``). Everything read is checked (frame checksums, storage CRCs, structure), and every problem surfaces as a
TraceError that names the file, so the CLI can print one line and exit 3. A trace whose recording never finished (a
killed job) reads up to its last complete chunk; ``truncated_after`` says where it stops. Reads are thread-safe
(a UI reads from worker threads) and every cache is bounded.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import stat
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch

from replaydiff.errors import NotRegularFile, TraceError, UsageError
from replaydiff.rebuild_and_judge import as_recorded, typed_storage
from replaydiff.trace import codec
from replaydiff.trace.format import (
    DATA_DIR,
    ENTERED,
    FORMAT_VERSION,
    FRAME_SUFFIX,
    INDEX,
    MAX_FRAME_BYTES,
    MANIFEST,
    OPS_DIR,
    data_file_name,
    open_regular,
    ops_chunk_name,
    rank_of_dir_name,
    read_frame,
    read_manifest_frame,
    read_regular,
)
from replaydiff.trace.damage import CutShort, MissingOps, find_missing
from replaydiff.trace.index import IndexBuilder, ModuleNode, TraceIndex
from replaydiff.trace.location import OpLocation, locate as locate_op
from replaydiff.trace.schema.environment import Environment
from replaydiff.trace.schema.index_rows import check_chunk
from replaydiff.trace.schema.left_out import LeftOut, left_out_from_manifest
from replaydiff.trace.schema.manifest import (CompiledRegion, FlightDump, RecordedOptions, check_manifest,
                                              manifest_bytes_written, manifest_command, manifest_flight,
                                              manifest_last_op, manifest_metadata, manifest_ops_files,
                                              manifest_stopped)
from replaydiff.trace.schema.op_wire import check_entered, wire_is_issued
from replaydiff.trace.schema.ops import OpRecord, RngState, StoredBytes
from replaydiff.trace.schema.plant import PlantedFaultInfo, plant_from_wire
from replaydiff.trace.schema.values import TensorRef
from replaydiff.trace.sources import SourceLine, locate, split_location


# Data files up to this size (a small trace's, or the first chunk of any) are read whole at their first storage: one
# read instead of one buffer and one pread per storage (a T5 step's 1,181 storages in 7 files: ~6% of its replay).
_WHOLE_FILE = 16 << 20


class DataFile:
    """One safetensors data file, read one tensor at a time with pread (no mmap, nothing loaded up front), or whole
    at its first read where it is small (``_WHOLE_FILE``).

    The format is a little-endian u64 header length, a JSON header naming each tensor's dtype, shape and byte range
    (plus string metadata: here each storage's codec, size and CRC), then the bytes. Parsed here rather than through
    safetensors.safe_open, which costs ~250 us per tensor; every field is checked before it is used.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        fd, _ = open_regular(path, "missing: ops of this trace read tensors from it (was the trace copied whole? "
                                   "`replaydiff show` says what is missing)")
        # The one place the descriptor is closed, at most once: by close(), on a bad header, or when the object is
        # collected. A second os.close of the number could close whatever file has reused it since (another
        # thread's), so there is no __del__ and no bare os.close anywhere else.
        self._close = weakref.finalize(self, os.close, fd)
        self.fd = fd
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
            header = json.loads(os.pread(fd, n, 8))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            meta = header.pop("__metadata__", None) or {}
            if not isinstance(meta, dict):
                raise ValueError("metadata is not a JSON object")
            self.metadata: dict = meta
            self.entries: dict = header
            self.data_start = 8 + n
            self.size = size
            # the bytes after the header, read at the first read() (None: not yet; False: storage by storage)
            self._data: torch.Tensor | None | bool = None if size - self.data_start <= _WHOLE_FILE else False
            self._view = memoryview(b"")  # of _data's bytes, once read (slices of it are handed to the decoder)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: JSON nested too deep
            self.close()
            raise TraceError(path, f"corrupt ({type(exc).__name__ if isinstance(exc, RecursionError) else exc})") \
                from None

    def read(self, key: str, view: bool = False) -> torch.Tensor | memoryview:
        """The raw bytes stored under ``key`` as a uint8 tensor; ValueError if the entry is not a sound byte range.

        With ``view`` it may be a memoryview into the whole file's bytes (read them only, while this file is open):
        for bytes about to be decoded. Without, a tensor of its own, as storages are rebuilt from (``as_strided``
        offsets count from a storage's start)."""
        e = self.entries.get(key)
        if not isinstance(e, dict):
            raise ValueError(f"storage {key} is not in this file")
        begin, end = e.get("data_offsets", (None, None))
        if e.get("dtype") != "U8" or not isinstance(begin, int) or not isinstance(end, int) \
                or not 0 <= begin <= end or self.data_start + end > self.size or e.get("shape") != [end - begin]:
            raise ValueError(f"storage {key} has a malformed entry")
        if not self._close.alive:
            raise ValueError(f"{self.path} is closed")
        if self._data is None:
            self._data = self._read_whole()
            if self._data is not False:
                self._view = codec.tensor_bytes_view(self._data)
        if self._data is not False:
            return self._view[begin:end] if view else codec.copy_bytes(self._data[begin:end])
        out = codec.empty_bytes(end - begin)
        got = os.preadv(self.fd, [codec.tensor_writable_view(out)], self.data_start + begin) if end > begin else 0
        if got != end - begin:
            raise ValueError(f"storage {key}: file ends early")
        return out

    def _read_whole(self) -> torch.Tensor | bool:
        """Every byte after the header, or False where the file cannot be read so (then each read says why)."""
        n = self.size - self.data_start
        out = codec.empty_bytes(n)
        try:
            got = os.preadv(self.fd, [codec.tensor_writable_view(out)], self.data_start) if n else 0
        except OSError:
            return False
        return out if got == n else False

    def close(self) -> None:
        """Close the descriptor (the first call only; later ones do nothing)."""
        try:
            self._close()
        except OSError:  # a descriptor the OS reports as bad: nothing left to release
            pass


class RankTrace(Sequence):
    """One rank's trace: a sequence of OpRecord, ``r[i]`` being op number ``i`` (lazy: one chunk at a time)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.manifest = self._read_manifest()
        self.rank = self.manifest.get("rank", 0)
        ops_dir = self.root / OPS_DIR
        firsts = []
        _no_link(self.root / DATA_DIR)
        if _no_link(ops_dir) and ops_dir.is_dir():
            for p in ops_dir.iterdir():
                if p.suffix == FRAME_SUFFIX and p.stem.isdigit():
                    firsts.append(int(p.stem))
        self._firsts = sorted(firsts)
        self._listed: dict[int, int] = {}  # first op -> last op of each ops chunk the manifest lists
        self._chunks: OrderedDict[int, list[dict]] = OrderedDict()
        self._files: OrderedDict[int, Any] = OrderedDict()
        self._storages: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._storage_total = 0
        self._index: TraceIndex | None = None
        self._lock = threading.RLock()
        self.complete = self.manifest.get("complete") is True
        # The metadata is parsed once: readers use attributes, and a missing or mistyped entry reads as None.
        self._environment, self._options, self._compiled_regions = manifest_metadata(self.manifest)
        self._missing = self._find_missing()

    # -- manifest ---------------------------------------------------------------------------------------------
    def _read_manifest(self) -> dict:
        path = self.root / MANIFEST
        m = read_manifest_frame(path)
        version = m.get("version")
        if not isinstance(version, int):
            raise TraceError(path, "manifest has no format version")
        if version > FORMAT_VERSION:
            raise TraceError(path, f"trace format version {version} is newer than this replaydiff understands "
                                   f"({FORMAT_VERSION}); upgrade replaydiff to read it")
        try:
            check_manifest(m)
        except ValueError as exc:
            raise TraceError(path, f"malformed manifest ({exc})") from None
        return m

    def _manifest_dict(self, key: str) -> dict:
        v = self.manifest.get(key)
        return v if isinstance(v, dict) else {}

    @property
    def environment(self) -> Environment:
        """The environment snapshot the rank was recorded in (typed once, at open)."""
        return self._environment

    @property
    def options(self) -> RecordedOptions:
        """The record options the trace was written with (see replaydiff.record.RecordOptions)."""
        return self._options

    @property
    def stopped(self) -> str | None:
        """Why the recording stopped part-way (the recorder's own failure: it warned "recording stopped"), or None."""
        return manifest_stopped(self.manifest)

    @property
    def cut_short(self) -> CutShort | None:
        """Where and why the recording of this rank ended before what it was asked for (``stopped``, or it never
        finished: ``truncated_after``), or None when it ended as asked. Such a trace is partial: what came after its
        last op was never recorded."""
        if self.stopped:
            return CutShort(self.rank, self.last_index, self.stopped)
        if not self.complete:
            return CutShort(self.rank, self.last_index, "the recording never finished (the process was killed or "
                                                        "died while recording)")
        return None

    @property
    def bytes_missing(self) -> int:
        """Bytes of the op chunks and data files the writer wrote (its final manifest counts them) that are not on disk
        now: a file deleted or cut short since, e.g. a trace copied in part. 0 when all are there, or when the
        manifest does not say (a recording that never finished)."""
        written = manifest_bytes_written(self.manifest) if self.complete else None
        if written is None:
            return 0
        on_disk = 0
        for sub in (OPS_DIR, DATA_DIR):
            try:
                on_disk += sum(st.st_size for st in (p.lstat() for p in (self.root / sub).iterdir()
                                                     if not p.name.endswith(".tmp"))
                               if stat.S_ISREG(st.st_mode))  # a link, a FIFO holds no byte of the trace
            except OSError:
                pass  # a directory that is gone holds nothing
        return max(written - on_disk, 0)

    def _find_missing(self) -> tuple[MissingOps, ...]:
        written = manifest_ops_files(self.manifest)
        if written is not None:  # every chunk on disk is one the writer lists, and holds only the ops it lists
            self._listed = {f.first: f.last for f in written}
            extra = [f for f in self._firsts if f not in self._listed]
            if extra:
                raise TraceError(self.root / OPS_DIR / ops_chunk_name(extra[0]),
                                 "not written by this recording (its manifest lists no ops file that starts at "
                                 f"op #{extra[0]})")
        missing = find_missing(self.rank, self.root / OPS_DIR, written, self.complete, manifest_last_op(self.manifest),
                               None if written is not None else self._last_on_disk())
        # A chunk on disk but not as written (cut short) is never read: its ops are missing, named as such.
        damaged = {m.first for m in missing if m.file_known}
        self._firsts = [f for f in self._firsts if f not in damaged]
        return missing

    @property
    def missing_ops(self) -> tuple[MissingOps, ...]:
        """Runs of ops whose records are gone since the trace was written (an ops file deleted, never copied or cut
        short), in op order; empty for a whole trace. Reading one of them (``r[i]``) raises a TraceError naming its
        file, and so does iterating past one; ``iter_from`` skips them (a replay judges what is there)."""
        return self._missing

    def missing_at(self, index: int) -> MissingOps | None:
        """The run of missing ops that holds op ``index``, or None."""
        return next((m for m in self._missing if m.first <= index <= m.last), None)

    @property
    def lost(self) -> list[str]:
        return list(self.manifest.get("lost") or [])

    @property
    def data_left_out(self) -> list[LeftOut]:
        """What the recording left out, per reason (record --budget, a full disk, a --module/--op filter): which
        ops kept statistics only and how many bytes of tensor data were not stored. Empty: nothing was left out
        (or the recording never finished; each op's ``data_left_out`` still says)."""
        return left_out_from_manifest(self.manifest)

    @property
    def command(self) -> tuple[str, ...] | None:
        """The command line the trace was recorded from (``replaydiff record -- python train.py``), or None: recorded
        from Python (``with replaydiff.record(...)``), or by an older replaydiff."""
        return manifest_command(self.manifest)

    @property
    def flight(self) -> FlightDump | None:
        """What the flight recorder said of its dump (why it wrote, the steps it held, its K), or None: the trace was
        not written by the flight recorder."""
        return manifest_flight(self.manifest)

    @property
    def world_size(self) -> int:
        return int(self.manifest.get("world_size") or 1)

    @property
    def custom_ops(self) -> dict[str, str]:
        """Custom ops seen while recording and the Python module that defined each (for replay to import)."""
        return self._manifest_dict("custom_ops")

    @property
    def planted(self) -> "PlantedFaultInfo | None":
        """The fault planted while recording (``record --plant``), or None: a trace made to test replay itself."""
        p = plant_from_wire(self.manifest.get("planted"), self.options.plant, self.rank)
        if p is None or not (p.landed and isinstance(p.call, int)):
            return p
        names = self.index.name
        hits = [i for i in range(len(self.index)) if names[i] == p.op]
        return replace(p, index=hits[p.call - 1] if len(hits) >= p.call else None)

    @property
    def source_files(self) -> dict[str, str]:
        """SHA-256 of each source file the ops' lines point into, as it was when recorded (file as in ``source``)."""
        return {k: v for k, v in self._manifest_dict("source_files").items() if isinstance(v, str)}

    @property
    def source_root(self) -> str | None:
        """The job's working directory: relative file names in ``source`` are relative to it."""
        v = self.manifest.get("source_root")
        return v if isinstance(v, str) else None

    def source_line(self, op: OpRecord) -> SourceLine | None:
        """The op's source line: its recorded text, today's file and whether that file has changed since."""
        loc = split_location(op.source)
        if loc is None:
            return None
        return locate(op.source, op.source_text, self.source_files.get(loc[0]), self.source_root)

    def location(self, op: OpRecord, text: bool = False) -> OpLocation:
        """Where ``op`` is (``trace/location.py``): its module and the line of the code it computes for, and what
        ran it. ``text``: with the line's text (reads the forward op's record; else its line comes from the index)."""
        def forward_source(i: int) -> tuple[str | None, str | None]:
            if text:
                fwd = self.op(i)
                return fwd.source, fwd.source_text
            return self.index.source[i], None
        return locate_op(op, forward_source)

    @property
    def compiled_regions(self) -> list[CompiledRegion]:
        """Compiled (torch.compile) regions entered while recording, and how they ran."""
        return list(self._compiled_regions)

    # -- ops --------------------------------------------------------------------------------------------------
    def _chunk(self, first: int) -> list[dict]:
        with self._lock:
            ops = self._chunks.get(first)
            if ops is not None:
                self._chunks.move_to_end(first)
                return ops
            path = self.root / OPS_DIR / f"{first:09d}{FRAME_SUFFIX}"
            frame = read_frame(path)
            try:
                ops = check_chunk(frame, first)
                last = self._listed.get(first)
                end = OpRecord(ops[-1]).index
                if last is not None and end > last:
                    raise ValueError(f"it holds op #{end}, the writer wrote up to op #{last} into it")
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceError(path, f"malformed ops chunk ({exc})") from None
            self._chunks[first] = ops
            if len(self._chunks) > 8:
                self._chunks.popitem(last=False)
            return ops

    def __len__(self) -> int:
        last = self.last_index
        return 0 if last is None else last + 1

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"rank {self.rank} has no op #{i} (0..{n - 1})")
        return self.op(i % n)

    def op(self, index: int) -> OpRecord:
        """Op number ``index``; an OpRecord with ``recorded`` False where the trace has no record of that number."""
        k = bisect.bisect_right(self._firsts, index) - 1
        if k >= 0:
            ops = self._chunk(self._firsts[k])
            j = index - self._firsts[k]
            if not (0 <= j < len(ops) and OpRecord(ops[j]).index == index):
                j = next((n for n, w in enumerate(ops) if OpRecord(w).index == index), -1)
            if j >= 0:
                return OpRecord(ops[j], self.rank, self.root / OPS_DIR / f"{self._firsts[k]:09d}{FRAME_SUFFIX}")
        gone = self.missing_at(index)
        if gone is not None:
            raise gone.error()
        if 0 <= index < len(self):
            return OpRecord.absent(index, self.rank)
        raise KeyError(index)

    def _records(self, first_index: int = 0) -> Iterator[OpRecord]:
        """Every op record from ``first_index`` on, stubs of ops that were numbered but not recorded included."""
        k = max(0, bisect.bisect_right(self._firsts, first_index) - 1)
        for first in self._firsts[k:]:
            path = self.root / OPS_DIR / f"{first:09d}{FRAME_SUFFIX}"
            for w in self._chunk(first):
                op = OpRecord(w, self.rank, path)
                if op.index >= first_index:
                    yield op

    def __iter__(self) -> Iterator[OpRecord]:
        """Every recorded op in order (numbers without a record, or with only a stub, are left out: ``r[i]`` gives
        them). On a damaged trace the TraceError of its first missing ops is raised where they would have come."""
        if not self._missing:
            return (op for op in self._records() if op.recorded)
        return self._iter_to_damage()

    def _iter_to_damage(self) -> Iterator[OpRecord]:
        gone = self._missing[0]
        for op in self._records():
            if op.index > gone.first:
                raise gone.error()
            if op.recorded:
                yield op
        raise gone.error()

    def iter_from(self, index: int) -> Iterator[OpRecord]:
        """Recorded ops numbered ``index`` and up, reading only the chunks that hold them; ops in missing files
        (``missing_ops``) are passed over: the caller says they are missing."""
        return (op for op in self._records(index) if op.recorded)

    def _last_on_disk(self) -> int | None:
        if not self._firsts:
            return None
        return OpRecord(self._chunk(self._firsts[-1])[-1]).index

    @property
    def last_index(self) -> int | None:
        last = self._last_on_disk()
        gone = max((m.last for m in self._missing), default=None)
        return last if gone is None or (last is not None and last > gone) else gone

    @property
    def entered(self) -> OpRecord | None:
        """The collective this rank had entered and not completed when its trace was last written (a rank waiting
        in it when the job hung or was killed): a stub OpRecord (``recorded`` False) with its process group in
        ``collective``; None when the rank was in no collective."""
        path = self.root / ENTERED
        if not os.path.lexists(path):
            return None
        try:
            frame = check_entered(read_frame(path))
            op = OpRecord(frame, self.rank, path)
        except ValueError as exc:
            raise TraceError(path, str(exc)) from None
        last = self.last_index
        if last is not None and op.index <= last and self.op(op.index).recorded and not wire_is_issued(frame):
            return None  # a marker left from a collective that then completed
        return op

    @property
    def truncated_after(self) -> int | None:
        """For a trace whose recording never finished: the last op that reads back (-1 if none)."""
        if self.complete:
            return None
        last = self.last_index
        return -1 if last is None else last

    def check_files(self) -> tuple[TraceError, ...]:
        """Every file of the rank read whole and checked as replay would read it: each ops chunk (its frame's
        checksum and its records' structure), the index, the entered-collective marker, and every storage of every
        data file (decoded: its checksum is of its bytes as recorded). One TraceError per damaged file, naming it;
        empty for a rank whose files are all intact. Reads every byte of the trace (memory: one storage at a time)."""
        problems: list[TraceError] = []
        missing = {m.path for m in self._missing}
        for first in self._firsts:
            path = self.root / OPS_DIR / f"{first:09d}{FRAME_SUFFIX}"
            if path in missing:
                continue
            try:
                with self._lock:
                    self._chunks.pop(first, None)  # read again from disk, not from the cache
                for w in self._chunk(first):  # every value decoded and checked, as replay decodes it
                    op = OpRecord(w, self.rank, path)
                    op.args, op.kwargs, op.outputs, op.writes, op.unit  # noqa: B018
            except TraceError as exc:
                problems.append(exc)
        if self._index is None:
            try:
                self.index  # noqa: B018 (read: a damaged index.rdt raises)
            except TraceError as exc:
                problems.append(exc)
        try:
            self.entered  # noqa: B018
        except TraceError as exc:
            problems.append(exc)
        data_dir = self.root / DATA_DIR
        try:
            names = sorted(p.name for p in data_dir.iterdir()) if data_dir.is_dir() else []
        except OSError as exc:
            names = []
            problems.append(TraceError(data_dir, f"unreadable ({exc.strerror or exc})"))
        for name in names:
            chunk = name.removesuffix(".safetensors")
            if not (name.endswith(".safetensors") and chunk.isdigit()):
                continue
            problem = self._check_data_file(int(chunk))
            if problem is not None:
                problems.append(problem)
        return tuple(problems)

    def _check_data_file(self, chunk: int) -> TraceError | None:
        path = self.root / DATA_DIR / data_file_name(chunk)
        try:
            f = DataFile(path)
        except TraceError as exc:
            return exc
        try:
            for key, meta in f.metadata.items():
                try:
                    codec_name, n, crc = meta.split(";")
                    raw = f.read(key, view=codec_name != "raw")
                    codec.decode(raw, codec_name, int(n), int(crc), f"storage {key}")
                except Exception as exc:  # whatever the bytes: this file is damaged, and says where
                    return TraceError(path, f"corrupt ({exc})")
        finally:
            f.close()
        return None

    # -- the index --------------------------------------------------------------------------------------------
    @property
    def index(self) -> TraceIndex:
        """Columns for every op and the producer/consumer edges (read from index.rdt, else rebuilt once)."""
        with self._lock:
            if self._index is None:
                self._index = self._load_index()
            return self._index

    def _load_index(self) -> TraceIndex:
        path = self.root / INDEX
        n = len(self)
        if os.path.lexists(path):
            # Damaged, it is refused as any file of the trace is (never read as clean), though it holds nothing the
            # chunks do not: without it, readers rebuild it from them. A recording that never finished may have
            # left one of fewer ops than its chunks hold: rebuilt.
            remove = "; it only indexes the op chunks: remove it and readers rebuild it from them"
            try:
                idx = TraceIndex.from_frame(read_frame(path))
            except NotRegularFile:
                raise
            except TraceError as exc:
                raise TraceError(path, exc.problem + remove) from None
            except ValueError as exc:
                raise TraceError(path, f"malformed index ({exc}){remove}") from None
            if idx.count == n:
                return idx
            if self.complete:
                raise TraceError(path, f"not as written (it indexes {idx.count} ops, the trace holds {n}){remove}")
        # Rebuilt in memory only: a reader never changes a trace (it may be read-only, or someone else's).
        builder = IndexBuilder()
        op = None
        try:
            for op in self._records():
                builder.add(op)
            builder.pad_to(n)  # ops of a missing last chunk are numbered, without a record
        except (ValueError, KeyError, TypeError) as exc:
            where = f" (op #{op.index})" if op is not None else ""
            raise TraceError(self.root / OPS_DIR, f"malformed op record{where}: {exc}") from None
        return builder.build()

    def producers(self, i: int) -> dict[int, int | None]:
        """{input position of op i: number of the op that produced it, or None (from outside the trace)}."""
        return self.index.producers(i)

    def consumers(self, i: int) -> dict[int, list[int]]:
        """{output position of op i: numbers of the ops that read it}."""
        return self.index.consumers(i)

    def modules(self) -> ModuleNode:
        return self.index.modules()

    # -- storages ---------------------------------------------------------------------------------------------
    def _file(self, chunk: int) -> DataFile:
        f = self._files.get(chunk)
        if f is None:
            f = DataFile(self.root / DATA_DIR / data_file_name(chunk))
            self._files[chunk] = f
            if len(self._files) > 8:
                self._files.popitem(last=False)[1].close()
        return f

    def data(self, ref: TensorRef | StoredBytes) -> torch.Tensor:
        """The decoded bytes of a stored storage version as a uint8 CPU tensor (shared: never write into it)."""
        if isinstance(ref, TensorRef):
            if not ref.stored:
                raise ValueError(f"{ref!r} has no stored bytes")
            version = int(ref.version)
            with self._lock:
                cached = self._storages.get(version)  # most reads: a storage an earlier op read or wrote
                if cached is not None:
                    self._storages.move_to_end(version)
                    return cached
            chunk = ref.chunk
            version, chunk, nbytes = version, int(chunk if chunk is not None else -1), int(ref.nbytes)
        else:
            version, chunk, nbytes = ref.version, ref.chunk, ref.nbytes
        with self._lock:
            return self._storage_bytes(version, chunk, nbytes)

    def _storage_bytes(self, version: int, chunk: int, nbytes: int) -> torch.Tensor:
        cached = self._storages.get(version)
        if cached is not None:
            self._storages.move_to_end(version)
            return cached
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        f = self._file(chunk)
        key = str(version)
        try:
            meta = f.metadata.get(key)
            if not isinstance(meta, str):
                raise ValueError(f"storage {key} is not in this file")
            codec_name, n, crc = meta.split(";")
            if int(n) != nbytes:
                raise ValueError(f"storage {key} holds {n} bytes, the op expects {nbytes}")
            raw = f.read(key, view=codec_name != "raw")  # "raw" bytes are the storage itself: its own tensor
            data = codec.decode(raw, codec_name, int(n), int(crc), f"storage {key}")
        except TraceError:
            raise
        except Exception as exc:
            raise TraceError(self.root / DATA_DIR / data_file_name(chunk), f"corrupt ({exc})") from None
        self._storages[version] = data
        self._storage_total += data.numel()
        while self._storage_total > (256 << 20) and len(self._storages) > 1:
            _, old = self._storages.popitem(last=False)
            self._storage_total -= old.numel()
        return data

    def rng_state(self, rng: RngState) -> torch.Tensor:
        """The generator state a random op ran with (a fresh uint8 tensor, for Generator.set_state)."""
        return self.data(rng.data).clone()

    def tensor(self, ref: TensorRef, copy: bool = False) -> torch.Tensor:
        """The recorded tensor of a reference, on CPU, in its recorded dtype, with its conj and neg bits.

        Without ``copy`` it is a view of cached bytes shared with other callers: read it, never write into it."""
        if not ref.stored_data:
            if ref.zero:  # a ZeroTensor: its shape is all the trace says of it, and memory may not hold it
                try:
                    return torch.zeros(ref.shape, dtype=ref.torch_dtype)
                except RuntimeError as exc:
                    raise TraceError(self.root, f"a zero tensor of shape {list(ref.shape)} cannot be made here "
                                                f"({str(exc).splitlines()[0][:120]})") from None
            if ref.meta:
                return ref.empty_meta()
        return rebuild(self.data(ref), ref.torch_dtype, ref, self.root, copy)


def rebuild(data: torch.Tensor, dtype: torch.dtype, ref: TensorRef, where: Path | str,
            copy: bool = True) -> torch.Tensor:
    """A tensor with the reference's size, stride, offset and conj/neg bits over a storage's bytes (or a copy)."""
    try:
        return as_recorded(typed_storage(data.clone() if copy else data, dtype), *ref.layout)
    except Exception as exc:
        raise TraceError(where, f"a tensor does not fit its storage ({exc})") from None


class Trace:
    """A whole trace: every rank found under the directory."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise TraceError(self.path, "no such trace directory")
        if not self.path.is_dir():
            raise TraceError(self.path, "not a trace directory (a file; give the directory `record -o` wrote)")
        if os.path.lexists(self.path / MANIFEST):
            dirs = [self.path]
        else:
            dirs = sorted((p for p in self.path.iterdir() if rank_of_dir_name(p.name) is not None
                           and _no_link(p) and p.is_dir()), key=lambda p: rank_of_dir_name(p.name))
        if not dirs:
            raise TraceError(self.path, "not a trace directory (no rank*/manifest.rdt inside)")
        self._ranks: dict[int, RankTrace] = {}
        for d in dirs:
            r = RankTrace(d)
            if r.rank in self._ranks:
                raise TraceError(d / MANIFEST, f"malformed manifest (rank {r.rank}, as "
                                               f"{self._ranks[r.rank].root / MANIFEST} says too)")
            self._ranks[r.rank] = r

    @property
    def ranks(self) -> list[int]:
        return sorted(self._ranks)

    def rank(self, rank: int) -> RankTrace:
        try:
            return self._ranks[rank]
        except KeyError:
            # the caller asked for what is not there; the trace itself is fine (exit 2, not 3)
            raise UsageError(f"rank {rank} is not in {self.path} (ranks: {self.ranks})") from None

    def __iter__(self) -> Iterator[RankTrace]:
        return iter(self._ranks[r] for r in self.ranks)

    @property
    def fingerprint(self) -> str:
        """A short hash of every rank's manifest as it is on disk: a trace recorded again at the same path (a new
        start time, other totals) has another, so a replay's results are never read as another recording's."""
        h = hashlib.sha256()
        for r in self.ranks:
            try:
                h.update(read_regular(self._ranks[r].root / MANIFEST, MAX_FRAME_BYTES))
            except TraceError:
                h.update(b"?")
        return h.hexdigest()[:16]

    @property
    def missing_ops(self) -> list[MissingOps]:
        """Every rank's ops whose records are gone since the trace was written (RankTrace.missing_ops)."""
        return [m for r in self.ranks for m in self._ranks[r].missing_ops]

    @property
    def cut_short(self) -> list[CutShort]:
        """Every rank whose recording ended before what it was asked for (RankTrace.cut_short)."""
        return [c for c in (self._ranks[r].cut_short for r in self.ranks) if c is not None]

    def check_whole(self) -> None:
        """A TraceError for the first missing ops (naming their file), for a verb that needs every op."""
        missing = self.missing_ops
        if missing:
            first = missing[0]
            more = sum(m.count for m in missing[1:])
            also = f"; {more} more op(s) in {len(missing) - 1} more file(s)" if more else ""
            err = first.error()
            raise TraceError(err.path, f"{err.problem}{also} (`replaydiff show {self.path}` says what is missing)")


def _no_link(path: Path) -> bool:
    """True; TraceError where ``path`` (a rank directory, ``ops/``, ``data/``) is a symbolic link: every file of a
    trace is read from inside its directory, never from where a link points."""
    if path.is_symlink():
        raise NotRegularFile(path, "a symbolic link: a trace is read from its own directories only, never through "
                                   "a link")
    return True


def open_trace(path: str | os.PathLike) -> Trace:
    """Open a trace directory (written by ``replaydiff.record``); raises TraceError if it cannot be read."""
    return Trace(Path(path))
