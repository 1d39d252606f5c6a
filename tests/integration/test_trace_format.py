"""The on-disk format: round trips, versioning, random access, truncated and damaged traces."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import replaydiff
import replaydiff.trace.reader as trace_reader
from replaydiff.errors import TraceError
from replaydiff.trace import open_trace
from replaydiff.trace.format import MANIFEST, pack_frame, read_frame, write_atomic

from trace_format_helpers import bits


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)


def codecs(rank_dir: Path) -> list[str]:
    out = []
    for f in sorted((rank_dir / "data").glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.extend(v.split(";")[0] for v in (fh.metadata() or {}).values())
    return out


# -- round trip of every dtype -----------------------------------------------------------------------------------
def _samples() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-30])
    out: dict[str, torch.Tensor] = {}
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        name = str(dt).removeprefix("torch.")
        out[name] = torch.cat([torch.randn(37, generator=g), special]).to(dt)
        out[name + "-smooth"] = torch.arange(256, dtype=dt).reshape(16, 16)  # compressible: zstd is kept
    out["int64"] = torch.randint(-(1 << 40), 1 << 40, (5, 7), generator=g)
    out["bool"] = torch.rand(19, generator=g) > 0.5
    out["uint8"] = torch.randint(0, 256, (33,), dtype=torch.uint8, generator=g)
    out["complex64"] = torch.complex(torch.randn(6, generator=g), torch.randn(6, generator=g))
    out["zero-size"] = torch.empty(0, 4)
    out["scalar"] = torch.tensor(3.25)
    out["strided"] = torch.arange(24.0).reshape(4, 6)[:, 1::2].t()  # a non-contiguous view with an offset
    return out


@pytest.mark.parametrize("compress", [True, False], ids=["zstd", "raw"])
def test_tensors_of_many_dtypes_round_trip_exactly(tmp_path, compress):
    samples = _samples()
    clones = {}
    with replaydiff.record(tmp_path / "t", compress=compress):
        for name, x in samples.items():
            clones[name] = x.clone()
    r = open_trace(tmp_path / "t").rank(0)
    ops = [o for o in r if o.name == "aten.clone.default"]
    assert len(ops) == len(samples)
    for (name, x), op in zip(samples.items(), ops):
        inp, out = op.args[0], op.outputs
        assert inp.dtype == str(x.dtype).removeprefix("torch.") and inp.shape == tuple(x.shape)
        assert inp.stored and out.stored, name
        got = r.tensor(inp)
        assert same_bits(got, x), name
        assert got.stride() == x.stride() and got.storage_offset() == x.storage_offset(), name
        assert same_bits(r.tensor(out), clones[name]), name
    used = codecs(tmp_path / "t" / "rank0")
    if compress:
        assert any(c.startswith("zstd") for c in used), used
    else:
        assert used and set(used) == {"raw"}


# -- format version ----------------------------------------------------------------------------------------------
def test_newer_format_version_is_refused(tmp_path):
    with replaydiff.record(tmp_path / "t"):
        torch.ones(2).add(1)
    path = tmp_path / "t" / "rank0" / MANIFEST
    manifest = read_frame(path)
    assert manifest["version"] == replaydiff.trace.FORMAT_VERSION
    manifest["version"] = 999
    write_atomic(path, pack_frame(manifest, None))
    with pytest.raises(TraceError) as err:
        open_trace(tmp_path / "t")
    assert "newer" in str(err.value) and "999" in str(err.value)
    assert err.value.exit_code == 3 and err.value.path == str(path)


def test_a_data_file_closes_its_descriptor_exactly_once(tmp_path):
    """A DataFile closed its descriptor a second time when collected: after a bad header (closed in __init__) and
    after cache eviction (close()). By then the number may be another file's, which silently lost it."""
    from replaydiff.trace.reader import DataFile

    with replaydiff.record(tmp_path / "t"):
        torch.randn(4).mul(2)
    data = sorted((tmp_path / "t" / "rank0" / "data").glob("*.safetensors"))[0]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)  # a header length far beyond the file
    other = tmp_path / "other.txt"
    other.write_bytes(b"another file")

    raised = None

    def lowest_free_descriptor() -> int:
        fd = os.open(os.devnull, os.O_RDONLY)
        os.close(fd)
        return fd

    for bad_header in (False, True):
        number = lowest_free_descriptor()
        if bad_header:  # __init__ closes it and raises; its frame (holding the half-made object) lives on a while
            with pytest.raises(TraceError) as raised:
                DataFile(bad)
            held = raised
        else:  # closed by the reader's cache on eviction, collected later
            held = DataFile(data)
            held.close()
        reused = os.open(other, os.O_RDONLY)
        try:
            assert reused == number  # the number the DataFile had and closed: now the other file's
            del held, raised
            gc.collect()
            assert os.pread(reused, 7, 0) == b"another"
        finally:
            os.close(reused)
    # Closing again is harmless, and reading after close is an error, not a read of whatever has the number now.
    f = DataFile(data)
    f.close()
    f.close()
    with pytest.raises((OSError, ValueError)):
        f.read(next(iter(f.entries)))


def test_a_trace_from_before_source_texts_reads_and_shows_without_them(tmp_path, cli_here, monkeypatch):
    """Source texts and file hashes are optional: a trace written without them reads as before (no text, no
    warning; today's line known inside the user's project, never shown) and ``show --op`` works."""
    user = tmp_path / "old_script.py"
    user.write_text("import torch\n\n\ndef work(x):\n    return torch.mul(x, 3)\n")
    import importlib.util

    spec = importlib.util.spec_from_file_location("old_script", user)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    x = torch.arange(4.0)
    with replaydiff.record(tmp_path / "t"):
        mod.work(x)
    rank_dir = tmp_path / "t" / "rank0"
    for chunk in (rank_dir / "ops").glob("*.rdt"):  # strip what older versions did not write
        frame = read_frame(chunk)
        for op in frame["ops"]:
            del op["srt"]
        write_atomic(chunk, pack_frame(frame, None))
    manifest = read_frame(rank_dir / MANIFEST)
    del manifest["source_files"], manifest["source_root"]
    del manifest["ops_files"]  # nor the list of ops files (their sizes changed above)
    write_atomic(rank_dir / MANIFEST, pack_frame(manifest, None))

    monkeypatch.chdir(tmp_path)  # the user's project: the only place a trace's named files are read
    r = open_trace(tmp_path / "t").rank(0)
    (mul,) = list(r)
    assert mul.source == f"{user}:5" and mul.source_text is None and r.source_files == {}
    line = r.source_line(mul)
    assert (line.recorded, line.changed, line.warning(), line.current) == (None, None, None, "return torch.mul(x, 3)")
    shown = cli_here("show", tmp_path / "t", "--op", "0")
    assert shown.returncode == 0, shown.stderr
    assert f"  source  {user}:5\n  schema" in shown.stdout


# -- random access -----------------------------------------------------------------------------------------------
def test_reading_op_n_opens_only_its_chunk(tmp_path, monkeypatch):
    x = torch.arange(8.0)
    with replaydiff.record(tmp_path / "t", chunk_ops=8):
        for k in range(20):
            x = x * 2 + k
    rank = tmp_path / "t" / "rank0"
    chunks = sorted((rank / "ops").glob("*.rdt"))
    assert [c.name for c in chunks] == [f"{8 * k:09d}.rdt" for k in range(5)]
    # Damage every other chunk: its ops file and its data file.
    for k in (0, 1, 3, 4):
        (rank / "ops" / f"{8 * k:09d}.rdt").write_bytes(b"garbage")
        data = rank / "data" / f"{k:06d}.safetensors"
        data.write_bytes(data.read_bytes()[:20])
    opened: list[Path] = []
    real_read_frame = trace_reader.read_frame
    monkeypatch.setattr(trace_reader, "read_frame", lambda p: (opened.append(Path(p)), real_read_frame(p))[1])
    r = open_trace(tmp_path / "t").rank(0)
    opened.clear()
    op = r.op(20)
    assert opened == [rank / "ops" / "000000016.rdt"]
    assert op.index == 20 and op.name == "aten.mul.Tensor"
    expected = torch.arange(8.0)
    for k in range(10):
        expected = expected * 2 + k
    assert torch.equal(r.tensor(op.args[0]), expected)
    assert torch.equal(r.tensor(op.outputs), expected * 2)
    with pytest.raises(TraceError) as err:
        r.op(5)
    assert "000000000.rdt" in str(err.value)


def test_old_or_damaged_metadata_reads_as_unknown_and_every_verb_still_runs(tmp_path, cli_here):
    """The environment, options and compiled regions are typed once at open: an entry an older recorder did not
    write reads as None, one of the wrong type as unknown (None), never a crash, in show, replay and report."""
    with replaydiff.record(tmp_path / "t"):
        torch.ones(3).mul(2)
    path = tmp_path / "t" / "rank0" / MANIFEST
    manifest = read_frame(path)
    env = manifest["environment"]
    del env["num_threads"], env["flags"]["cuda.matmul.allow_tf32"]
    env["torch"], env["devices"], env["variables"] = 2, "a GPU", ["NCCL_ALGO"]
    manifest["options"] = {"tensors": "full", "steps": 7}
    manifest["compiled_regions"] = [{"region": "f", "calls": "two", "how": "eager"}, "not a region"]
    write_atomic(path, pack_frame(manifest, None))

    r = open_trace(tmp_path / "t").rank(0)
    e = r.environment
    assert (e.num_threads, e.torch, e.devices, e.variables) == (None, None, (), {})
    assert e.flags.matmul_tf32 is None and e.flags.cudnn_tf32 is not None and e.rank == 0
    assert (r.options.tensors, r.options.steps) == ("full", None)
    (region,) = r.compiled_regions
    assert (region.region, region.calls, region.how) == ("f", None, "eager")
    t, j = str(tmp_path / "t"), str(tmp_path / "r.json")
    for verb in (["show", t], ["show", t, "--json"], ["replay", t, "--json", j], ["report", t, "--replay", j],
                 ["diff", t, t]):
        done = cli_here(*verb)
        assert done.returncode == 0, (verb, done.stderr)
