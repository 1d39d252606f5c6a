"""Layout and framing of a trace directory.

A trace is a directory holding one ``rank<N>/`` sub-directory per process. Each rank directory holds

- ``manifest.rdt``: format version, environment, options; rewritten (atomically) when recording ends, with
  ``complete: true`` and what was lost;
- ``index.rdt``: one column per field for every op and the producer/consumer edges (``index.py``), written when
  recording ends, rebuilt by a reader when missing;
- ``ops/<first-op-index>.rdt``: a chunk of op records, msgpack, written atomically once the chunk is full;
- ``data/<chunk>.safetensors``: the storage bytes first seen in that chunk, one uint8 tensor per storage version,
  optionally byte-shuffled and zstd-compressed, each with its CRC in the safetensors metadata.

Every msgpack file is framed as ``MAGIC | flags | crc32 | length | payload`` so that a flipped or missing byte is
caught before the payload is decoded: a damaged trace is reported, never silently misread. Nothing here ever uses
pickle; decoding a trace runs no code.

Every checksum of a trace (frames here, storages in ``codec``) is CRC-32, zlib's function, computed by zlib-ng where
it is installed: the same values at memory speed (SIMD carry-less multiplication: ~10 GB/s here against ~2 GB/s for
zlib 1.2.13, which a ``full`` recording's writer thread spent ~140 ms a mid step in), so a trace written with either
implementation reads with the other and the format is unchanged.
"""
from __future__ import annotations

import os
import stat
import struct
import zlib
from pathlib import Path
from typing import Any, Callable

import msgpack
import zstandard

from replaydiff.errors import TraceError

FORMAT_NAME = "replaydiff.trace"
FORMAT_VERSION = 1

MANIFEST = "manifest.rdt"
INDEX = "index.rdt"
# The collective the rank was inside, not yet completed, when the trace was last written (hang debugging).
ENTERED = "entered.rdt"
OPS_DIR = "ops"
DATA_DIR = "data"
FRAME_SUFFIX = ".rdt"


def _fast_crc32():
    """zlib-ng's crc32 if it is installed and is zlib's CRC-32 (checked on fixed inputs), else zlib's own."""
    try:
        from zlib_ng import zlib_ng

        probe = bytes(range(256)) * 17
        if zlib_ng.crc32(b"123456789") == 0xCBF43926 and zlib_ng.crc32(probe) == zlib.crc32(probe) and \
                zlib_ng.crc32(probe, 12345) == zlib.crc32(probe, 12345):
            return zlib_ng.crc32
    except Exception:  # not installed (an exotic platform without its wheel), or broken: zlib computes the same
        pass
    return zlib.crc32


# CRC-32 of a bytes-like object (storages, frames): every checksum of a trace, written or read, goes through it.
crc32 = _fast_crc32()


_MAGIC = b"RDT\x01"
_HEADER = struct.Struct("<4sBIQ")  # magic, flags, crc32 of payload, payload length
_FLAG_ZSTD = 1
# A single frame never legitimately decompresses beyond this; a hand-made one that claims more is refused.
_MAX_FRAME_BYTES = 1 << 31


def rank_dir_name(rank: int) -> str:
    return f"rank{rank}"


def rank_of_dir_name(name: str) -> int | None:
    """The rank a directory named ``rank<N>`` holds, or None for any other name."""
    return int(name[4:]) if name.startswith("rank") and name[4:].isdigit() else None


def ops_chunk_name(first_index: int) -> str:
    return f"{first_index:09d}{FRAME_SUFFIX}"


def data_file_name(chunk_no: int) -> str:
    return f"{chunk_no:06d}.safetensors"


def pack_frame(obj: Any, compress_level: int | None) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    flags = 0
    if compress_level is not None:
        payload = zstandard.ZstdCompressor(level=compress_level).compress(payload)
        flags |= _FLAG_ZSTD
    return _HEADER.pack(_MAGIC, flags, crc32(payload), len(payload)) + payload


def unpack_frame(data: bytes, path: Path | str) -> Any:
    """Decode one frame, raising TraceError (naming ``path``) for anything that is not a whole, intact frame."""
    if len(data) < _HEADER.size:
        raise TraceError(path, f"truncated ({len(data)} bytes, not even a header)")
    magic, flags, crc, length = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise TraceError(path, "not a replaydiff trace file (bad magic bytes)")
    payload = data[_HEADER.size:]
    if len(payload) != length:
        raise TraceError(path, f"truncated ({len(payload)} of {length} payload bytes)")
    if crc32(payload) != crc:
        raise TraceError(path, "corrupt (checksum mismatch)")
    if flags & ~_FLAG_ZSTD:
        raise TraceError(path, f"unknown frame flags {flags:#x}")
    try:
        if flags & _FLAG_ZSTD:
            payload = zstandard.ZstdDecompressor().decompress(payload, max_output_size=_MAX_FRAME_BYTES)
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # zstd or msgpack errors: the file is damaged even though its checksum matched
        raise TraceError(path, f"corrupt ({type(exc).__name__}: {exc})") from None


def has_frame_magic(path: Path) -> bool:
    """Whether ``path`` starts as every frame does (a cheap test of whose file it is; nothing is decoded)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(_MAGIC)) == _MAGIC
    except OSError:
        return False


def read_manifest_frame(path: Path) -> dict:
    """The manifest at ``path`` as written (any format version); TraceError if it is not a replaydiff manifest."""
    m = read_frame(path)
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise TraceError(path, "not a replaydiff trace manifest")
    return m


def read_frame(path: Path) -> Any:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TraceError(path, "missing") from None
    except OSError as exc:
        raise TraceError(path, f"unreadable ({exc.strerror or exc})") from None
    return unpack_frame(data, path)


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary name and rename, so a crash leaves either the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
    os.replace(tmp, path)


def write_atomic_via(path: Path, write: Callable[[Path], None]) -> None:
    """``write_atomic`` for a writer that takes a file name (safetensors): ``write(tmp)``, then rename.

    safetensors writes through a temporary file of its own, mode 600 whatever the umask. A trace (and a repro) is
    handed to colleagues, so the file gets the mode any new file gets here: that of ``tmp`` as created first by us.
    os.umask cannot be read without setting it, which would race with files the job's other threads create."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a stale one keeps its old mode; ``write`` would replace it anyway
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)
    except BaseException:
        tmp.unlink(missing_ok=True)  # ours: made above, or written by ``write`` over it
        raise
    os.replace(tmp, path)
