"""Reading a trace lazily: the manifest at open, one ops chunk and one storage at a time on demand.

Everything read is checked (frame checksums, storage CRCs, structure), and every problem surfaces as a TraceError
that names the file, so the CLI can print one line and exit 3. A trace whose recording never finished (a killed
job) reads up to its last complete chunk; ``truncated_after`` says where it stops.
"""
from __future__ import annotations

import bisect
import json
import os
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import torch

from replaydiff.errors import TraceError
from replaydiff.record.encode import TENSOR_KEY, dtype_from_name
from replaydiff.trace import codec
from replaydiff.trace.format import (
    DATA_DIR,
    FORMAT_NAME,
    FORMAT_VERSION,
    FRAME_SUFFIX,
    MANIFEST,
    OPS_DIR,
    data_file_name,
    read_frame,
)


class DataFile:
    """One safetensors data file, read one tensor at a time with pread (no mmap, nothing loaded up front).

    The format is a little-endian u64 header length, a JSON header naming each tensor's dtype, shape and byte range
    (plus string metadata: here each storage's codec, size and CRC), then the bytes. Parsed here rather than through
    safetensors.safe_open, which costs ~250 us per tensor; every field is checked before it is used.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise TraceError(path, "missing") from None
        except OSError as exc:
            raise TraceError(path, f"unreadable ({exc.strerror or exc})") from None
        try:
            size = os.fstat(self.fd).st_size
            head = os.pread(self.fd, 8, 0)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
            header = json.loads(os.pread(self.fd, n, 8))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            meta = header.pop("__metadata__", None) or {}
            if not isinstance(meta, dict):
                raise ValueError("metadata is not a JSON object")
            self.metadata: dict = meta
            self.entries: dict = header
            self.data_start = 8 + n
            self.size = size
        except (ValueError, UnicodeDecodeError) as exc:
            os.close(self.fd)
            raise TraceError(path, f"corrupt ({exc})") from None

    def read(self, key: str) -> torch.Tensor:
        """The raw bytes stored under ``key`` as a uint8 tensor; ValueError if the entry is not a sound byte range."""
        e = self.entries.get(key)
        if not isinstance(e, dict):
            raise ValueError(f"storage {key} is not in this file")
        begin, end = e.get("data_offsets", (None, None))
        if e.get("dtype") != "U8" or not isinstance(begin, int) or not isinstance(end, int) \
                or not 0 <= begin <= end or self.data_start + end > self.size or e.get("shape") != [end - begin]:
            raise ValueError(f"storage {key} has a malformed entry")
        out = torch.empty(end - begin, dtype=torch.uint8)
        got = os.preadv(self.fd, [codec.tensor_writable_view(out)], self.data_start + begin) if end > begin else 0
        if got != end - begin:
            raise ValueError(f"storage {key}: file ends early")
        return out

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass

    def __del__(self) -> None:
        self.close()


class RankReader:
    """One rank's trace."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.manifest = self._read_manifest()
        self.rank = int(self.manifest.get("rank", 0))
        ops_dir = self.root / OPS_DIR
        firsts = []
        if ops_dir.is_dir():
            for p in ops_dir.iterdir():
                if p.suffix == FRAME_SUFFIX and p.stem.isdigit():
                    firsts.append(int(p.stem))
        self._firsts = sorted(firsts)
        self._chunks: OrderedDict[int, list[dict]] = OrderedDict()
        self._files: OrderedDict[int, Any] = OrderedDict()
        self._storages: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._storage_total = 0
        self.complete = bool(self.manifest.get("complete"))

    # -- manifest ---------------------------------------------------------------------------------------------
    def _read_manifest(self) -> dict:
        path = self.root / MANIFEST
        m = read_frame(path)
        if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
            raise TraceError(path, "not a replaydiff trace manifest")
        version = m.get("version")
        if not isinstance(version, int):
            raise TraceError(path, "manifest has no format version")
        if version > FORMAT_VERSION:
            raise TraceError(path, f"trace format version {version} is newer than this replaydiff understands "
                                   f"({FORMAT_VERSION}); upgrade replaydiff to read it")
        return m

    @property
    def environment(self) -> dict:
        env = self.manifest.get("environment")
        return env if isinstance(env, dict) else {}

    @property
    def lost(self) -> list[str]:
        return list(self.manifest.get("lost") or [])

    # -- ops --------------------------------------------------------------------------------------------------
    def _chunk(self, first: int) -> list[dict]:
        ops = self._chunks.get(first)
        if ops is not None:
            self._chunks.move_to_end(first)
            return ops
        path = self.root / OPS_DIR / f"{first:09d}{FRAME_SUFFIX}"
        frame = read_frame(path)
        try:
            ops = frame["ops"]
            if frame["first"] != first or not isinstance(ops, list) or not ops:
                raise ValueError("chunk does not match its name")
            prev = first - 1
            for op in ops:
                if not isinstance(op, dict) or not isinstance(op["i"], int) or op["i"] <= prev:
                    raise ValueError("op numbers out of order")
                if not isinstance(op["op"], str):
                    raise ValueError("op without a name")
                prev = op["i"]
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(path, f"malformed ops chunk ({exc})") from None
        self._chunks[first] = ops
        if len(self._chunks) > 4:
            self._chunks.popitem(last=False)
        return ops

    def __iter__(self) -> Iterator[dict]:
        for first in self._firsts:
            yield from self._chunk(first)

    def iter_from(self, index: int) -> Iterator[dict]:
        """Ops numbered ``index`` and up, reading only the chunks that hold them."""
        k = max(0, bisect.bisect_right(self._firsts, index) - 1)
        for first in self._firsts[k:]:
            for op in self._chunk(first):
                if op["i"] >= index:
                    yield op

    def op(self, index: int) -> dict:
        k = bisect.bisect_right(self._firsts, index) - 1
        if k >= 0:
            for op in self._chunk(self._firsts[k]):
                if op["i"] == index:
                    return op
        raise KeyError(index)

    @property
    def last_index(self) -> int | None:
        if not self._firsts:
            return None
        return self._chunk(self._firsts[-1])[-1]["i"]

    @property
    def truncated_after(self) -> int | None:
        """For a trace whose recording never finished: the last op that reads back (-1 if none)."""
        if self.complete:
            return None
        last = self.last_index
        return -1 if last is None else last

    # -- storages ---------------------------------------------------------------------------------------------
    def _file(self, chunk: int) -> DataFile:
        f = self._files.get(chunk)
        if f is None:
            f = DataFile(self.root / DATA_DIR / data_file_name(chunk))
            self._files[chunk] = f
            if len(self._files) > 8:
                self._files.popitem(last=False)[1].close()
        return f

    def storage_bytes(self, version: int, chunk: int, nbytes: int) -> torch.Tensor:
        """The decoded bytes of one storage version as a uint8 CPU tensor (shared: do not write into it)."""
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
            raw = f.read(key)
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

    def has_data(self, ref: dict) -> bool:
        return isinstance(ref, dict) and ref.get(TENSOR_KEY) is not None and ("f" in ref or ref.get("sb") == 0)

    def tensor(self, ref: dict, copy: bool = False) -> torch.Tensor:
        """The recorded tensor of a reference, on CPU, in its recorded dtype.

        Without ``copy`` it is a view of cached bytes shared with other callers: read it, never write into it."""
        dtype = dtype_from_name(ref["dt"])
        data = self.storage_bytes(int(ref[TENSOR_KEY]), int(ref.get("f", -1)), int(ref.get("sb", 0)))
        return rebuild(data, dtype, ref, self.root, copy)


def rebuild(data: torch.Tensor, dtype: torch.dtype, ref: dict, where: Path | str, copy: bool = True) -> torch.Tensor:
    """A tensor with the reference's size, stride and offset over a storage's bytes (or a copy of them)."""
    itemsize = dtype.itemsize
    try:
        n = data.numel() - data.numel() % itemsize
        base = data[:n]
        base = (base.clone() if copy else base).view(dtype)
        return base.as_strided(ref["sh"], ref["st"], ref["of"])
    except Exception as exc:
        raise TraceError(where, f"a tensor does not fit its storage ({exc})") from None


class TraceReader:
    """A whole trace: every rank found under the directory."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise TraceError(self.path, "no such trace directory")
        if (self.path / MANIFEST).exists():
            dirs = [self.path]
        else:
            dirs = sorted((p for p in self.path.iterdir() if p.is_dir() and p.name.startswith("rank")
                           and p.name[4:].isdigit()), key=lambda p: int(p.name[4:]))
        if not dirs:
            raise TraceError(self.path, "not a trace directory (no rank*/manifest.rdt inside)")
        self.ranks: dict[int, RankReader] = {}
        for d in dirs:
            r = RankReader(d)
            self.ranks[r.rank] = r

    def rank(self, rank: int) -> RankReader:
        try:
            return self.ranks[rank]
        except KeyError:
            raise TraceError(self.path, f"the trace holds no rank {rank}") from None


def open_trace(path: str | Path) -> TraceReader:
    return TraceReader(Path(path))
