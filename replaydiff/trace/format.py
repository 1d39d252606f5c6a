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

import errno
import os
import stat
import struct
import zlib
from pathlib import Path
from typing import Any, Callable

import msgpack
import zstandard

from replaydiff.errors import NotRegularFile, TraceError

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
MAX_FRAME_BYTES = 1 << 31
# Nor beyond this many times its compressed size, or the floor: the writer's frames (msgpack at zstd level 1) come
# out 5-15 times smaller, and zstd can reach ~32,000 times on repeated bytes, so a 60 KB frame could otherwise ask
# for gigabytes before its first byte is checked. Decoded, a frame's objects take at most ~8 bytes a payload byte.
_MAX_FRAME_RATIO = 512
_FRAME_FLOOR = 16 << 20


def frame_size_limit(compressed: int) -> int:
    """The most bytes a zstd frame of ``compressed`` bytes is allowed to decompress to."""
    return min(MAX_FRAME_BYTES, max(_FRAME_FLOOR, _MAX_FRAME_RATIO * compressed))


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
    payload = memoryview(data)[_HEADER.size:]
    if len(payload) < length:
        raise TraceError(path, f"truncated ({len(payload)} of {length} payload bytes)")
    if len(payload) > length:
        raise TraceError(path, f"not as written ({len(payload) - length} bytes after its {length} payload bytes)")
    if crc32(payload) != crc:
        raise TraceError(path, "corrupt (checksum mismatch)")
    if flags & ~_FLAG_ZSTD:
        raise TraceError(path, f"unknown frame flags {flags:#x}")
    if flags & _FLAG_ZSTD:
        payload = _decompress(payload, path)
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack errors (and its depth limit): the file is damaged though its checksum matched
        raise TraceError(path, f"corrupt ({type(exc).__name__}: {exc})") from None


def _decompress(payload: memoryview, path: Path | str) -> bytes:
    """A frame's zstd payload decompressed, within ``frame_size_limit``: a size the frame's own header claims is
    checked before anything is allocated (zstd allocates it whole), and one it does not claim bounds the output."""
    limit = frame_size_limit(len(payload))
    try:
        claimed = zstandard.frame_content_size(payload)
        if claimed > limit:
            raise TraceError(path, f"corrupt (a frame of {len(payload)} bytes claims {claimed} bytes decompressed; "
                                   f"at most {limit} are read)")
        return zstandard.ZstdDecompressor().decompress(payload, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise TraceError(path, f"corrupt (zstd: {exc})") from None


def has_frame_magic(path: Path) -> bool:
    """Whether ``path`` starts as every frame does (a cheap test of whose file it is; nothing is decoded)."""
    try:
        fd, _ = open_regular(path)
    except TraceError:
        return False
    with os.fdopen(fd, "rb") as fh:
        try:
            return fh.read(len(_MAGIC)) == _MAGIC
        except OSError:
            return False


def read_manifest_frame(path: Path) -> dict:
    """The manifest at ``path`` as written (any format version); TraceError if it is not a replaydiff manifest."""
    m = read_frame(path)
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise TraceError(path, "not a replaydiff trace manifest")
    return m


def open_regular(path: Path | str, missing: str = "missing") -> tuple[int, int]:
    """``(descriptor, size)`` of a trace file opened for reading; TraceError (``missing`` when it is not there) for
    anything but a regular file: a symbolic link (to /dev/zero, to a file outside the trace), a FIFO (which would
    block the reader), a device, a directory. Never follows a link and never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise TraceError(path, missing) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(path, "a symbolic link: a trace is read from regular files only, never through a "
                                       "link") from None
        raise TraceError(path, f"unreadable ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise TraceError(path, f"unreadable ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(path, f"not a regular file ({_file_kind(st.st_mode)}): a trace is read from regular "
                                   f"files only")
    return fd, st.st_size


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a file"


def read_regular(path: Path | str, most: int, missing: str = "missing") -> bytes:
    """The whole of a regular trace file (``open_regular``) of at most ``most`` bytes; TraceError when it is larger
    (nothing is read then)."""
    fd, size = open_regular(path, missing)
    with os.fdopen(fd, "rb") as fh:
        if size > most:
            raise TraceError(path, f"too large ({size} bytes; at most {most} are read)")
        try:  # as many bytes as fstat said (read(n) allocates n at once), and no more than ``most``
            data = fh.read(size + 1)
            if len(data) > most:
                raise TraceError(path, f"too large (more than {most} bytes are not read)")
            return data
        except OSError as exc:
            raise TraceError(path, f"unreadable ({exc.strerror or exc})") from None


def read_frame(path: Path) -> Any:
    """The decoded frame at ``path``: read from a regular file only, and only as many bytes as its header declares
    (a file that holds more or fewer is refused)."""
    fd, size = open_regular(path)
    with os.fdopen(fd, "rb") as fh:
        try:
            head = fh.read(_HEADER.size)
            if len(head) < _HEADER.size or head[:len(_MAGIC)] != _MAGIC:
                return unpack_frame(head, path)  # raises: too short for a header, or not a frame
            length = _HEADER.unpack_from(head)[3]
            if length != size - _HEADER.size:
                raise TraceError(path, f"truncated ({max(size - _HEADER.size, 0)} of {length} payload bytes)"
                                 if length > size - _HEADER.size else
                                 f"not as written ({size - _HEADER.size - length} bytes after its {length} "
                                 f"payload bytes)")
            if length > MAX_FRAME_BYTES:
                raise TraceError(path, f"corrupt (a frame of {length} bytes; at most {MAX_FRAME_BYTES} are read)")
            data = head + fh.read(length)
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
