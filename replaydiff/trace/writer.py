"""Writing one rank's trace as it goes, on a background thread, never raising into the caller.

The recording thread hands over full chunks (op records plus the storage snapshots first seen in them); the writer
thread waits for any device-to-host copies, encodes, and writes the data file and then the ops file, each atomically.
A chunk's ops file therefore never exists without its data, and a process killed mid-step leaves a readable prefix.
Memory stays bounded, so a slow disk slows the job rather than filling host memory: the queue holds at most two
chunks, and the tensor copies waiting to be written live in ``staging.py``'s memory (the recorder's own mappings,
outside the job's heap), at most ``queue_bytes`` at once. A blob is encoded into its own staging bytes, so its
encoded form costs nothing more. The writer thread also builds the index (``index.py``) of what it wrote, and stores
it when recording ends.
"""
from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import safetensors
import torch

from replaydiff import device as seam
from replaydiff.errors import warn_job
from replaydiff.trace import codec
from replaydiff.trace.index import IndexBuilder
from replaydiff.trace.staging import Slot, Staging
from replaydiff.trace.schema.index_rows import chunk_frame
from replaydiff.trace.schema.left_out import LEFT_OUT_DEVICE_PENDING, LEFT_OUT_DISK_FULL, LeftOutTally
from replaydiff.trace.schema.manifest import wire_writer_totals
from replaydiff.trace.schema.op_wire import wire_index, wire_issued, wire_strip_chunks, wire_strip_versions
from replaydiff.trace.format import (
    DATA_DIR,
    ENTERED,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX,
    MANIFEST,
    OPS_DIR,
    data_file_name,
    ops_chunk_name,
    pack_frame,
    write_atomic,
    write_atomic_via,
)

log = logging.getLogger("replaydiff")


@dataclass
class Snapshot:
    """A copy of one storage version's bytes, possibly still in flight from a device."""

    version: int
    # The bytes: writable memory (staging memory, a bytearray), or a CPU uint8 tensor (pinned, filled from a GPU)
    data: memoryview | bytearray | torch.Tensor
    itemsize: int
    # What says the bytes have landed, for a copy a device makes: ``wait(timeout) -> bool`` (the device seam's
    # ``Arrival``, or a late copy of a host storage a device writes) and ``abandon()`` once given up
    event: Any = None
    slot: Slot | None = None  # what the writer gives back to its Staging once the bytes are written

    @property
    def nbytes(self) -> int:
        return self.data.numel() if isinstance(self.data, torch.Tensor) else len(self.data)

    def writable(self) -> memoryview:
        return codec.tensor_writable_view(self.data) if isinstance(self.data, torch.Tensor) else memoryview(self.data)


@dataclass
class _Chunk:
    number: int
    ops: list[dict] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    pending_bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    # Run by the writer thread before the chunk is encoded: fill what its records hold but the recording thread had
    # not yet got (device statistics on their way to the host; RankWriter.defer).
    fills: list[Callable[[float], bool]] = field(default_factory=list)


FIRST_CHUNK_BYTES = 8 << 20


class CodecChoice:
    """Whether the writer compresses the next blob (``compress=True``): zstd costs the job nothing while the writer
    keeps up, so then always; once it falls behind (another chunk waits while it writes one, or the job waits for
    it: a copy waits for staging room, the recording ends), only if zstd gets a blob to disk sooner than raw would:
    compressing a byte plus writing what remains of it must take less time than writing the byte
    (``1/C + R/W < 1/W``, compression rate C, ratio R, disk rate W). Rates are this run's own, measured on its blobs
    and data files (moving averages; the first data chunk is small so that W is known early); while behind, one
    blob in ``PROBE`` is compressed anyway, so that C and R follow the data (at 1 in 32 that costs a few percent of
    the raw rate).

    Why: measured on float data, zstd level 1 runs at 200-500 MB/s on one core and saves 8-20% of the bytes (ReLU
    outputs ~40%; negative levels save nothing on floats), while writes to the page cache run at 1 GB/s or more: a
    writer that compressed everything set the pace of a large recording at half the raw rate.
    On a slow disk, or data that compresses well, compressing is the faster choice and is kept."""

    PROBE = 32
    _WEIGHT = 0.25  # of the newest measurement in a moving average

    def __init__(self) -> None:
        self.compress_s_per_byte: float | None = None
        self.ratio: float | None = None
        self.write_s_per_byte: float | None = None
        self.behind_blobs = 0
        self.raw_blobs = 0  # blobs stored raw by this choice (a benchmark prints it)

    def compress(self, behind: bool) -> bool:
        if not behind:
            return True
        self.behind_blobs += 1
        c, r, w = self.compress_s_per_byte, self.ratio, self.write_s_per_byte
        if c is None or r is None or w is None or self.behind_blobs % self.PROBE == 0:
            return True
        if c + r * w < w:
            return True
        self.raw_blobs += 1
        return False

    def note_compressed(self, nbytes: int, encoded: int, seconds: float) -> None:
        if nbytes >= 1 << 16:  # small blobs measure call overhead, not the rate
            self.compress_s_per_byte = self._average(self.compress_s_per_byte, seconds / nbytes)
            self.ratio = self._average(self.ratio, encoded / nbytes)

    def note_written(self, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 16:
            self.write_s_per_byte = self._average(self.write_s_per_byte, seconds / nbytes)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self._WEIGHT * (new - old)


class RankWriter:
    def __init__(self, root: Path, manifest: dict, compress_level: int | None, shuffle: bool = True,
                 chunk_ops: int = 256, chunk_bytes: int = 64 << 20, flush_seconds: float = 0.5,
                 queue_bytes: int = 256 << 20, compress_auto: bool = False) -> None:
        self.root = root
        self.flush_seconds = flush_seconds
        self.compress_level = compress_level
        # With compress_auto, zstd only where it costs the job no time: see CodecChoice.
        self.codec_choice = CodecChoice() if compress_auto and compress_level is not None else None
        self.shuffle = shuffle
        self.chunk_ops = chunk_ops
        # A chunk goes to the writer well before the staging memory is full, so one chunk is filled while another
        # is written.
        self.chunk_bytes = max(1, min(chunk_bytes, queue_bytes // 4))
        # The first data chunk is small, so that the rate of writes is measured before much data is waiting.
        self._chunk_bytes_now = min(self.chunk_bytes, FIRST_CHUNK_BYTES)
        self.staging = Staging(queue_bytes, self.flush)
        self.lost: list[str] = []
        self.failed = False
        self.bytes_written = 0
        # Bytes of everything but tensor data written so far (op records, data file headers): record --budget keeps
        # room for more of them (record/budget.py).
        self.records_bytes = 0
        # A full disk (ENOSPC): tensor data stops (data files from chunk data_lost_from on are never written, and
        # records lose their references into them), op records with statistics go on. data_refused says why to the
        # recording thread, which then stores no more data.
        self.data_refused: str | None = None
        self.data_lost_from: int | None = None
        self.left_out = LeftOutTally()
        self.ops_written = 0
        self.last_op_written: int | None = None
        # (first op, last op, bytes) of each ops chunk written: the final manifest lists them, so a reader can name
        # a chunk deleted or cut short since (a trace copied in part).
        self.ops_files: list[tuple[int, int, int]] = []
        self._manifest = dict(manifest, format=FORMAT_NAME, version=FORMAT_VERSION, complete=False)
        (root / OPS_DIR).mkdir(parents=True, exist_ok=True)
        (root / DATA_DIR).mkdir(parents=True, exist_ok=True)
        self._write_manifest()
        self._chunk = _Chunk(0)
        self._index = IndexBuilder()
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        # Guards the current chunk: the recording thread fills it, the writer thread takes it when it has waited
        # flush_seconds (a job hung inside an op, then killed, still leaves everything before that op). Reentrant:
        # a SIGTERM handler may flush while the interrupted recording thread holds it.
        self._lock = threading.RLock()
        # The collective the recording thread is inside: (stub record, since). Written to ENTERED by the writer
        # thread once it has waited flush_seconds, so a rank stuck in it (then killed) says which one it entered.
        # With an event: a collective issued to a device, which has not done it until the event completes.
        self._in_flight: tuple[dict, float, Any] | None = None
        self._entered_written: dict | None = None
        # Storage versions whose device copy had not landed by the deadline: their data is never written, and
        # records of later chunks that name them are stripped of them too. Their copies are held until they land.
        self._pending_versions: set[int] = set()
        self._abandoned: list[Snapshot] = []
        self._stalled = False  # a device wait ran out: later waits only look (a hung device stalls once)
        self._thread = threading.Thread(target=self._run, name="replaydiff-writer", daemon=True)
        self._thread.start()

    # -- recording thread -------------------------------------------------------------------------------------
    @property
    def chunk_number(self) -> int:
        return self._chunk.number

    def add_snapshot(self, snap: Snapshot) -> int:
        with self._lock:
            chunk = self._chunk
            chunk.snapshots.append(snap)
            chunk.pending_bytes += snap.nbytes
            return chunk.number

    def defer(self, fill: Callable[[float], bool]) -> None:
        """Run ``fill`` on the writer thread before the current chunk (or, if it is taken meanwhile, the next) is
        encoded; records added after this call may hold what ``fill`` fills. Chunks are written in order.
        ``fill(timeout)`` waits up to ``timeout`` seconds for what it needs from a device and says whether it got it
        (called again until it does or the writer's deadline passes; then the records go without)."""
        with self._lock:
            self._chunk.fills.append(fill)

    def add_op(self, record: dict) -> None:
        with self._lock:
            chunk = self._chunk
            chunk.ops.append(record)
            if len(chunk.ops) >= self.chunk_ops or chunk.pending_bytes >= self._chunk_bytes_now \
                    or time.monotonic() - chunk.started >= self.flush_seconds:
                self.flush()

    def enter_collective(self, stub: dict) -> None:
        """The recording thread is about to wait in a collective (a plain assignment: the hot path stays cheap).
        A collective a device has not finished yet keeps its place: the first one not done is what a hang waits on."""
        cur = self._in_flight
        if cur is not None and cur[2] is not None and (seam.queries_held() or not cur[2].query()):
            return
        self._in_flight = (stub, time.monotonic(), None)

    def leave_collective(self, event: Any = None) -> None:
        """The collective returned; with ``event``, it was issued to a device and is done when the event is."""
        cur = self._in_flight
        if cur is None or cur[2] is not None:
            return
        self._in_flight = None if event is None else (cur[0], cur[1], event)

    def _note_in_flight(self, force: bool = False) -> None:
        cur = self._in_flight
        if cur is not None and cur[2] is not None and not seam.queries_held() and cur[2].query():  # the device did it
            self._in_flight = cur = None
            if self._entered_written is not None:
                self._entered_written = None
                try:
                    (self.root / ENTERED).unlink(missing_ok=True)
                except OSError as exc:
                    log.debug("stale entered-collective marker left: %s", exc)
        if cur is None or cur[0] is self._entered_written:
            return
        stub, since, event = cur
        if force or time.monotonic() - since >= self.flush_seconds:
            try:
                write_atomic(self.root / ENTERED, pack_frame(stub if event is None else wire_issued(stub), None))
                self._entered_written = stub
            except Exception as exc:
                log.debug("the entered-collective marker could not be written: %s", exc)

    def flush(self) -> None:
        """Hand the current chunk to the writer thread (blocks while two chunks are already waiting)."""
        with self._lock:
            chunk = self._chunk
            if not chunk.ops and not chunk.snapshots and not chunk.fills:
                return
            self._chunk = _Chunk(chunk.number + 1)
            if not self.failed:
                self._queue.put(chunk)
            else:
                self._release(chunk)

    def sync(self, timeout: float) -> bool:
        """Flush, and wait up to ``timeout`` seconds until everything handed over is on disk."""
        self.flush()
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def _take_stale(self) -> None:
        """Writer thread, idle: hand over the current chunk if it has waited flush_seconds (never blocks)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            chunk = self._chunk
            if chunk.ops and time.monotonic() - chunk.started >= self.flush_seconds and not self._queue.full():
                self._chunk = _Chunk(chunk.number + 1)
                if not self.failed:
                    self._queue.put_nowait(chunk)
                else:
                    self._release(chunk)
        finally:
            self._lock.release()

    def close(self, extra: dict) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join()
        self._release_landed(final=True)
        self.staging.trim()
        cur = self._in_flight
        if cur is not None and cur[2] is not None:  # a collective the device may still be running: give it time
            seam.wait(cur[2], seam.EVENT_DEADLINE)
            self._note_in_flight()
        if self._in_flight is not None:
            self._note_in_flight(force=True)  # a collective that raised (a timeout) was entered, never completed
        elif self._entered_written is not None:  # a marker of a slow collective that then completed
            try:
                (self.root / ENTERED).unlink(missing_ok=True)
            except OSError as exc:  # a reader ignores a marker whose op has a full record anyway
                log.debug("stale entered-collective marker left: %s", exc)
        if not self.failed:
            try:
                write_atomic(self.root / INDEX, pack_frame(self._index.to_frame(), 1))
            except Exception as exc:  # a reader rebuilds a missing index: worth a debug line, not a warning
                log.debug("the index could not be written: %s", exc)
        self._manifest.update(extra)
        self._manifest.update(self.left_out.wire())
        self._manifest.update(complete=True, lost=self.lost, **wire_writer_totals(
            self.ops_written, self.last_op_written, list(self.ops_files), self.bytes_written))
        try:
            self._write_manifest()
        except Exception as exc:
            self._fail(f"the final manifest could not be written ({exc}); the trace will read as truncated")

    def write_manifest_now(self) -> None:
        """Rewrite the manifest as it stands (still incomplete), e.g. with a ``lost`` line before the process dies."""
        self._manifest.update(lost=self.lost, **wire_writer_totals(self.ops_written, self.last_op_written,
                                                                    list(self.ops_files)))
        self._write_manifest()
        self._note_in_flight(force=True)

    def note_lost(self, what: str) -> None:
        if len(self.lost) < 100:
            self.lost.append(what)

    # -- writer thread ----------------------------------------------------------------------------------------
    def _write_manifest(self) -> None:
        self._manifest["written_at"] = time.time()
        write_atomic(self.root / MANIFEST, pack_frame(self._manifest, None))

    def _fail(self, why: str) -> None:
        if not self.failed:
            warn_job(f"recording degraded: {why}")
        self.failed = True
        self.note_lost(why)
        self.staging.unbound()  # chunks are dropped from now on: a copy waiting for room must not wait forever

    def _run(self) -> None:
        while True:
            try:
                chunk = self._queue.get(timeout=self.flush_seconds / 2)
            except queue.Empty:
                self._take_stale()
                self._note_in_flight()
                self._release_landed()
                if self._queue.empty():  # idle (between recorded steps): staging memory back to the system
                    self.staging.trim()
                continue
            if chunk is None:
                return
            if isinstance(chunk, threading.Event):
                chunk.set()
                continue
            if self.failed:
                self._release(chunk)
                continue
            try:
                self._write_chunk(chunk)
            except Exception as exc:  # disk full, permissions, anything: recording stops, training goes on
                first = wire_index(chunk.ops[0]) if chunk.ops else "?"
                self._fail(f"writing chunk {chunk.number} failed ({type(exc).__name__}: {exc}); "
                           f"ops from #{first} on were not written")
            finally:
                self._release(chunk)

    def _release(self, chunk: _Chunk) -> None:
        """Give the chunk's copies back to the staging memory (written, or dropped after a failure)."""
        snapshots, chunk.snapshots = chunk.snapshots, []
        for snap in snapshots:
            if snap.slot is not None:
                self.staging.release(snap.slot)

    def _disk_full(self, chunk: _Chunk, exc: BaseException) -> None:
        """The disk is full: no more tensor data from this chunk on, one warning; op records go on (the same case
        as record --budget, with the budget found the hard way)."""
        self.data_lost_from = chunk.number
        first = wire_index(chunk.ops[0]) if chunk.ops else "?"
        why = (f"the disk is full ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}): tensor data "
               f"stops at op #{first}; later ops are kept with statistics (reason: {LEFT_OUT_DISK_FULL})")
        self.note_lost(why)
        warn_job(why)
        self.data_refused = LEFT_OUT_DISK_FULL

    def _await(self, wait: Callable[[float], bool]) -> bool:
        """Wait for a device (``Snapshot.event.wait``, a deferred fill) up to ``seam.EVENT_DEADLINE``, writing the
        marker of a collective entered meanwhile; after one wait ran out, only look until a copy lands again."""
        end = time.monotonic() + (0.0 if self._stalled else seam.EVENT_DEADLINE)
        while True:
            if wait(max(0.0, min(self.flush_seconds / 2, end - time.monotonic()))):
                self._stalled = False
                return True
            self._note_in_flight()
            if time.monotonic() >= end:
                self._stalled = True
                return False

    def _release_landed(self, final: bool = False) -> None:
        """Give back the copies given up on whose device copy has since landed (at the end: wait a little, then
        leave them to torch, which frees pinned memory once its copy completes)."""
        if not self._abandoned:
            return
        keep = []
        end = time.monotonic() + (1.0 if final else 0.0)  # one second for all of them, at most
        for snap in self._abandoned:
            if snap.event.wait(max(0.0, end - time.monotonic())) or final:
                if snap.slot is not None:
                    self.staging.release(snap.slot)
            else:
                keep.append(snap)
        self._abandoned = keep

    def _write_chunk(self, chunk: _Chunk) -> None:
        fills, chunk.fills = chunk.fills, []
        for fill in fills:
            self._await(fill)
        for snap in chunk.snapshots:
            if snap.event is not None and not self._await(snap.event.wait):
                # Not landed by the deadline (a hung kernel ahead of the copy): the records go on without it
                snap.event.abandon()
                self._pending_versions.add(snap.version)
                if len(self._pending_versions) == 1:
                    self.note_lost(f"a device had not finished the work before the copies of some tensors after "
                                   f"{seam.EVENT_DEADLINE:g} s (a hung kernel or collective?): from chunk "
                                   f"{chunk.number} on, ops are written without those tensors' data (reason: "
                                   f"{LEFT_OUT_DEVICE_PENDING})")
        if self._pending_versions:
            pending = [s for s in chunk.snapshots if s.version in self._pending_versions]
            if pending:
                chunk.snapshots = [s for s in chunk.snapshots if s.version not in self._pending_versions]
                self._abandoned.extend(pending)
                self.left_out.add_bytes(LEFT_OUT_DEVICE_PENDING, sum(s.nbytes for s in pending))
            for op in chunk.ops:
                wire_strip_versions(op, self._pending_versions, LEFT_OUT_DEVICE_PENDING)
        if self.data_lost_from is None:
            try:
                self._write_data(chunk)
            except Exception as exc:
                if not _disk_full(exc):
                    raise
                self._disk_full(chunk, exc)
        if self.data_lost_from is not None:  # this chunk's data is not on disk: neither is what refers to it
            self.left_out.add_bytes(LEFT_OUT_DISK_FULL, sum(s.nbytes for s in chunk.snapshots))
            for op in chunk.ops:
                wire_strip_chunks(op, self.data_lost_from, LEFT_OUT_DISK_FULL)
        self._release(chunk)  # the data file is written (or never will be): its copies are free
        if chunk.ops:
            frame = pack_frame(chunk_frame(chunk.ops, chunk.number), self.compress_level)
            write_atomic(self.root / OPS_DIR / ops_chunk_name(wire_index(chunk.ops[0])), frame)
            self.bytes_written += len(frame)
            self.records_bytes += len(frame)
            self.ops_written += len(chunk.ops)
            self.last_op_written = wire_index(chunk.ops[-1])
            self.ops_files.append((wire_index(chunk.ops[0]), self.last_op_written, len(frame)))
            for op in chunk.ops:
                self._index.add(op)
                self.left_out.add_op(op)

    def _write_data(self, chunk: _Chunk) -> None:
        specs: dict[str, Any] = {}
        metadata: dict[str, str] = {}
        keep_alive: list[Any] = []
        for snap in chunk.snapshots:
            choice = self.codec_choice
            # Behind: more is handed over than this chunk (or the recording ends, or a sync waits: the sentinel is
            # queued), or a copy waits for staging room.
            zstd = choice is None or choice.compress(behind=not self._queue.empty() or self.staging.waiting)
            started = time.perf_counter()
            blob = codec.encode(snap.writable(), snap.itemsize, self.compress_level if zstd else None, self.shuffle)
            if choice is not None and zstd:
                choice.note_compressed(blob.nbytes, len(blob.data), time.perf_counter() - started)
            if blob.nbytes == 0:
                continue
            data = blob.data
            keep_alive.append(data)
            ptr = codec.buffer_address(data)
            key = str(snap.version)
            specs[key] = safetensors.TensorSpec(dtype="uint8", shape=[len(data)], data_ptr=ptr, data_len=len(data))
            metadata[key] = f"{blob.codec};{blob.nbytes};{blob.crc}"
        if specs:
            path = self.root / DATA_DIR / data_file_name(chunk.number)
            started = time.perf_counter()
            write_atomic_via(path, lambda tmp: safetensors.serialize_file(specs, str(tmp), metadata=metadata))
            size = path.stat().st_size
            if self.codec_choice is not None:
                self.codec_choice.note_written(size, time.perf_counter() - started)
            self._chunk_bytes_now = self.chunk_bytes
            self.bytes_written += size
            self.records_bytes += size - sum(len(d) for d in keep_alive)


def _disk_full(exc: BaseException) -> bool:
    """Whether a write failed for want of space: an OSError ENOSPC/EDQUOT, or safetensors' error, which carries
    the OS error only in its text ("No space left on device (os error 28)")."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 5:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text or "StorageFull" in text:
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False
