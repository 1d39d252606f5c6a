"""Writing one rank's trace as it goes, on a background thread, never raising into the caller.

The recording thread hands over full chunks (op records plus the storage snapshots first seen in them); the writer
thread waits for any device-to-host copies, encodes, and writes the data file and then the ops file, each atomically.
A chunk's ops file therefore never exists without its data, and a process killed mid-step leaves a readable prefix.
The queue is bounded, so memory stays bounded: a slow disk slows the job rather than filling host memory. The
writer thread also builds the index (``index.py``) of what it wrote, and stores it when recording ends.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors
import torch

from replaydiff.trace import codec
from replaydiff.trace.index import IndexBuilder
from replaydiff.trace.schema import chunk_frame, wire_index
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
    data: bytearray | torch.Tensor  # the bytes (CPU), or a pinned uint8 tensor being filled from a GPU
    itemsize: int
    event: Any = None  # torch.cuda.Event to wait on before reading ``data``


@dataclass
class _Chunk:
    number: int
    ops: list[dict] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    pending_bytes: int = 0
    started: float = field(default_factory=time.monotonic)


class RankWriter:
    def __init__(self, root: Path, manifest: dict, compress_level: int | None, shuffle: bool = True,
                 chunk_ops: int = 256, chunk_bytes: int = 64 << 20, flush_seconds: float = 0.5) -> None:
        self.root = root
        self.flush_seconds = flush_seconds
        self.compress_level = compress_level
        self.shuffle = shuffle
        self.chunk_ops = chunk_ops
        self.chunk_bytes = chunk_bytes
        self.lost: list[str] = []
        self.failed = False
        self.bytes_written = 0
        self.ops_written = 0
        self.last_op_written: int | None = None
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
        self._in_flight: tuple[dict, float] | None = None
        self._entered_written: dict | None = None
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
            chunk.pending_bytes += len(snap.data) if isinstance(snap.data, bytearray) else snap.data.numel()
            return chunk.number

    def add_op(self, record: dict) -> None:
        with self._lock:
            chunk = self._chunk
            chunk.ops.append(record)
            if len(chunk.ops) >= self.chunk_ops or chunk.pending_bytes >= self.chunk_bytes \
                    or time.monotonic() - chunk.started >= self.flush_seconds:
                self.flush()

    def enter_collective(self, stub: dict) -> None:
        """The recording thread is about to wait in a collective (a plain assignment: the hot path stays cheap)."""
        self._in_flight = (stub, time.monotonic())

    def leave_collective(self) -> None:
        self._in_flight = None

    def _note_in_flight(self, force: bool = False) -> None:
        cur = self._in_flight
        if cur is None or cur[0] is self._entered_written:
            return
        stub, since = cur
        if force or time.monotonic() - since >= self.flush_seconds:
            try:
                write_atomic(self.root / ENTERED, pack_frame(stub, None))
                self._entered_written = stub
            except Exception as exc:
                log.debug("the entered-collective marker could not be written: %s", exc)

    def flush(self) -> None:
        """Hand the current chunk to the writer thread (blocks while two chunks are already waiting)."""
        with self._lock:
            chunk = self._chunk
            if not chunk.ops and not chunk.snapshots:
                return
            self._chunk = _Chunk(chunk.number + 1)
            if not self.failed:
                self._queue.put(chunk)

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
        finally:
            self._lock.release()

    def close(self, extra: dict) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join()
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
        self._manifest.update(complete=True, lost=self.lost, ops_written=self.ops_written,
                              last_op=self.last_op_written, data_bytes=self.bytes_written)
        try:
            self._write_manifest()
        except Exception as exc:
            self._fail(f"the final manifest could not be written ({exc}); the trace will read as truncated")

    def write_manifest_now(self) -> None:
        """Rewrite the manifest as it stands (still incomplete), e.g. with a ``lost`` line before the process dies."""
        self._manifest.update(lost=self.lost, ops_written=self.ops_written, last_op=self.last_op_written)
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
            warnings.warn(f"replaydiff: recording degraded: {why}", RuntimeWarning, stacklevel=2)
        self.failed = True
        self.note_lost(why)

    def _run(self) -> None:
        while True:
            try:
                chunk = self._queue.get(timeout=self.flush_seconds / 2)
            except queue.Empty:
                self._take_stale()
                self._note_in_flight()
                continue
            if chunk is None:
                return
            if isinstance(chunk, threading.Event):
                chunk.set()
                continue
            if self.failed:
                continue
            try:
                self._write_chunk(chunk)
            except Exception as exc:  # disk full, permissions, anything: recording stops, training goes on
                first = wire_index(chunk.ops[0]) if chunk.ops else "?"
                self._fail(f"writing chunk {chunk.number} failed ({type(exc).__name__}: {exc}); "
                           f"ops from #{first} on were not written")

    def _write_chunk(self, chunk: _Chunk) -> None:
        specs: dict[str, Any] = {}
        metadata: dict[str, str] = {}
        keep_alive: list[Any] = []
        for snap in chunk.snapshots:
            if snap.event is not None:
                snap.event.synchronize()
            blob = codec.encode(snap.data, snap.itemsize, self.compress_level, self.shuffle)
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
            write_atomic_via(path, lambda tmp: safetensors.serialize_file(specs, str(tmp), metadata=metadata))
            self.bytes_written += path.stat().st_size
        del keep_alive
        if chunk.ops:
            frame = pack_frame(chunk_frame(chunk.ops, chunk.number), self.compress_level)
            write_atomic(self.root / OPS_DIR / ops_chunk_name(wire_index(chunk.ops[0])), frame)
            self.bytes_written += len(frame)
            self.ops_written += len(chunk.ops)
            self.last_op_written = wire_index(chunk.ops[-1])
            for op in chunk.ops:
                self._index.add(op)
