"""Trace checksums come from zlib-ng's crc32 where it is installed: zlib's CRC-32, computed at memory speed. The
values must be zlib's, so the committed fixture (written with zlib) still reads, and a trace written now reads with
zlib's function (an older replaydiff)."""
from __future__ import annotations

import importlib.util
import random
import zlib
from pathlib import Path

import pytest
import torch

import replaydiff
from replaydiff import open_trace
from replaydiff.errors import TraceError
from replaydiff.trace import codec, format as fmt

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def _every_storage(path: Path) -> int:
    """Decode every stored storage version of rank 0 (each one's checksum checked); how many there were."""
    rank = open_trace(path).rank(0)
    seen = set()
    for op in rank:
        for ref in [*op.inputs(), *op.outputs_refs()]:
            if ref.stored and ref.version not in seen:
                seen.add(ref.version)
                assert rank.data(ref).numel() == ref.nbytes
    return len(seen)


def test_the_fast_checksum_is_used_where_zlib_ng_is_installed() -> None:
    if importlib.util.find_spec("zlib_ng") is None:
        assert fmt.crc32 is zlib.crc32
    else:
        from zlib_ng import zlib_ng

        assert fmt.crc32 is zlib_ng.crc32 and codec.crc32 is zlib_ng.crc32


@pytest.mark.parametrize("size", [0, 1, 3, 7, 8, 15, 63, 64, 4095, 4096, 4097, 65_537, (1 << 20) + 3])
def test_the_checksum_is_zlib_s_crc32(size: int) -> None:
    rng = random.Random(size)
    data = bytearray(rng.getrandbits(8) for _ in range(min(size, 70_000))) * max(1, size // 70_000 + 1)
    data = data[:size]
    view = memoryview(data)
    for start in (0, 1, 3):  # unaligned starts: SIMD paths handle heads and tails apart
        part = view[start:]
        assert fmt.crc32(part) == zlib.crc32(part)
        assert fmt.crc32(part, 0x1234ABCD) == zlib.crc32(part, 0x1234ABCD)


def test_the_committed_fixture_written_with_zlib_reads_and_verifies() -> None:
    assert _every_storage(FIXTURES / "mlp-fault") > 10


def test_a_damaged_storage_is_still_caught(tmp_path: Path) -> None:
    t = torch.arange(4096, dtype=torch.float32)
    blob = codec.encode(memoryview(bytearray(t.numpy().tobytes())), 4, None, False)
    data = torch.frombuffer(bytearray(blob.data), dtype=torch.uint8)
    assert codec.decode(data, blob.codec, blob.nbytes, blob.crc, "x").numel() == blob.nbytes
    flipped = data.clone()
    flipped[1000] ^= 4
    with pytest.raises(ValueError, match="checksum mismatch"):
        codec.decode(flipped, blob.codec, blob.nbytes, blob.crc, "x")
    frame = bytearray(fmt.pack_frame([1, 2, 3], None))
    frame[-1] ^= 1
    with pytest.raises(TraceError, match="checksum"):
        fmt.unpack_frame(bytes(frame), "f")


def test_a_trace_written_now_reads_with_zlib_s_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    with replaydiff.record(tmp_path / "t", tensors="full", compress=True):
        lin(torch.randn(4, 16)).square().sum().backward()
    monkeypatch.setattr(fmt, "crc32", zlib.crc32)
    monkeypatch.setattr(codec, "crc32", zlib.crc32)
    assert _every_storage(tmp_path / "t") >= 4
