"""Encoding of raw storage bytes: optional byte-shuffle, optional zstd, always a CRC.

Byte-shuffle groups the k-th byte of every element together; for floats the exponent bytes then sit side by side and
zstd finds far more repetition (10-15% smaller traces of float data). It pays only for multi-byte elements.
The codec string travels with the blob (``raw``, ``zstd``, ``zstd+shuffle4`` ...), so a reader needs nothing else.

The checksum is CRC-32 (``format.crc32``: zlib's function, at memory speed where zlib-ng is installed).
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch
import zstandard

from replaydiff.trace.format import crc32


_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_memory_view.restype = ctypes.py_object
_PYBUF_READ = 0x100
_PYBUF_WRITE = 0x200


def tensor_bytes_view(u8: torch.Tensor) -> memoryview:
    """A zero-copy, read-only memoryview of a contiguous CPU uint8 tensor (torch offers none without numpy).

    The tensor must outlive the view. (A ctypes array type per length would do too, but creating one costs
    ~100 us, more than the bytes it views.)"""
    assert u8.dtype == torch.uint8 and u8.device.type == "cpu" and u8.is_contiguous()
    n = u8.numel()
    if n == 0:
        return memoryview(b"")
    return _memory_view(u8.data_ptr(), n, _PYBUF_READ)


def buffer_address(buf: bytes | bytearray | memoryview) -> int:
    """The address of a bytes object's, a bytearray's or a writable memoryview's data (for memmove and safetensors'
    TensorSpec)."""
    if isinstance(buf, (bytearray, memoryview)):
        return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if len(buf) else 0
    return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value or 0


def address_view(address: int, nbytes: int) -> memoryview:
    """A read-only memoryview of ``nbytes`` at ``address`` (a CPU storage's data), without copying."""
    return _memory_view(address, nbytes, _PYBUF_READ) if nbytes else memoryview(b"")


def tensor_writable_view(u8: torch.Tensor) -> memoryview:
    """Like tensor_bytes_view, but writable: for reading a file straight into a tensor."""
    assert u8.dtype == torch.uint8 and u8.device.type == "cpu" and u8.is_contiguous()
    if u8.numel() == 0:
        return memoryview(bytearray())
    return _memory_view(u8.data_ptr(), u8.numel(), _PYBUF_WRITE)


_U8 = torch.empty(0, dtype=torch.uint8)


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor from torch's allocator (aligned as torch.empty's are), without the NaN fill
    torch.empty does under deterministic algorithms (replay's settings): that fill is a pass over memory about to
    be overwritten, and an intra-op parallel region where replay runs the recorded thread count. (A tensor made
    over a new storage: ``Tensor.new`` costs two thirds of ``torch.empty(0).set_``, called per storage read.)"""
    return _U8.new(torch.UntypedStorage(nbytes))


def copy_bytes(u8: torch.Tensor) -> torch.Tensor:
    """A copy of a contiguous uint8 CPU tensor (as ``empty_bytes``, and copied by memmove: no parallel region)."""
    n = u8.numel()
    out = empty_bytes(n)
    if n:
        # Between the data pointers, not through Tensor.numpy(): that marks a storage not resizable for good, and
        # an op that grows its in-place argument (addbmm_ of a [1] tensor into [5, 10]) then fails.
        ctypes.memmove(out.data_ptr(), u8.data_ptr(), n)
    return out


def bytes_to_u8(data: bytes) -> torch.Tensor:
    """A copy of ``data`` in memory from torch's allocator (aligned as a tensor torch made is): replay runs ops on
    decoded storages as they are, and a kernel's result may depend on its inputs' alignment (MKL's may)."""
    out = empty_bytes(len(data))
    if len(data):
        ctypes.memmove(out.data_ptr(), data, len(data))
    return out


@dataclass(frozen=True)
class EncodedBlob:
    data: memoryview  # the encoded bytes: a prefix of the buffer given to encode
    codec: str
    nbytes: int  # decoded size
    crc: int  # crc32 of the decoded bytes


def encode(buf: memoryview, itemsize: int, level: int | None, shuffle: bool) -> EncodedBlob:
    """Encode one storage's bytes in place: ``buf`` (writable) ends up holding the encoded bytes at its start.

    In place, so that a chunk's encoded blobs, kept until its data file is written, take no memory beyond the
    copies themselves (zstd's output for one blob lives only until it is copied back)."""
    raw = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    crc = crc32(raw)
    n = len(raw)
    if level is None or n == 0:
        return EncodedBlob(raw, "raw", n, crc)
    codec = "zstd"
    src: memoryview | bytes = raw
    if shuffle and itemsize > 1 and n % itemsize == 0:
        shuffled = torch.frombuffer(raw, dtype=torch.uint8).view(-1, itemsize).t().contiguous()
        src = bytes(tensor_bytes_view(shuffled))
        codec = f"zstd+shuffle{itemsize}"
    packed = compressor(level).compress(src)
    if len(packed) >= n:  # incompressible (random bits): keep it raw, decoding is then free
        return EncodedBlob(raw, "raw", n, crc)
    raw[:len(packed)] = packed
    return EncodedBlob(raw[:len(packed)], codec, n, crc)


_compressors = threading.local()


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level`` (a compressor is not thread-safe; making one per blob costs its
    context's allocation every time)."""
    cache = getattr(_compressors, "by_level", None)
    if cache is None:
        cache = _compressors.by_level = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level)
    return c


_decompressors = threading.local()


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor (not thread-safe; making one per blob cost ~18 us, a third of decoding a small
    one)."""
    d = getattr(_decompressors, "one", None)
    if d is None:
        d = _decompressors.one = zstandard.ZstdDecompressor()
    return d


def decode(data: torch.Tensor | memoryview, codec: str, nbytes: int, crc: int, where: str) -> torch.Tensor:
    """Inverse of ``encode``; raises ValueError (the reader turns it into a TraceError) on any inconsistency.
    ``data``: the encoded bytes, a uint8 tensor (the one returned for ``raw``) or, for a compressed codec, a
    memoryview."""
    if codec == "raw":
        out = data if isinstance(data, torch.Tensor) else bytes_to_u8(bytes(data))
    elif codec.startswith("zstd"):
        rest = codec[4:]
        itemsize = 1
        if rest:
            if not rest.startswith("+shuffle") or not rest[8:].isdigit():
                raise ValueError(f"unknown codec {codec!r}")
            itemsize = int(rest[8:])
            if itemsize < 2 or nbytes % itemsize:
                raise ValueError(f"codec {codec!r} does not fit {nbytes} bytes")
        src = data if isinstance(data, memoryview) else tensor_bytes_view(data.contiguous())
        try:
            # zstd allocates the size a frame's header claims, whatever max_output_size says: a claim other than
            # the recorded size is refused before anything is allocated
            claimed = zstandard.frame_content_size(src)
            if claimed != -1 and claimed != nbytes:
                raise ValueError(f"{where}: its compressed bytes claim {claimed} bytes where {nbytes} were recorded")
            plain = decompressor().decompress(src, max_output_size=max(nbytes, 1))
        except zstandard.ZstdError as exc:
            raise ValueError(f"zstd: {exc}") from None
        if itemsize == 1:  # checked on the decompressed bytes as they are (no view of a tensor to make)
            if len(plain) != nbytes:
                raise ValueError(f"{where}: {len(plain)} bytes where {nbytes} were recorded")
            if crc32(plain) != crc:
                raise ValueError(f"{where}: checksum mismatch")
            return bytes_to_u8(plain)
        out = bytes_to_u8(plain)
        if out.numel() == nbytes:
            out = out.view(itemsize, -1).t().contiguous().view(-1)
    else:
        raise ValueError(f"unknown codec {codec!r}")
    if out.numel() != nbytes:
        raise ValueError(f"{where}: {out.numel()} bytes where {nbytes} were recorded")
    if crc32(tensor_bytes_view(out.contiguous())) != crc:
        raise ValueError(f"{where}: checksum mismatch")
    return out
