"""A trace is untrusted input: crafted or damaged files of every kind make each verb that reads a trace exit 0, 1 or
3 with at most one error line naming the file, never a traceback, never a hang, never gigabytes of memory; and a trace
whose bytes fail their checksum is never called clean. The quick setting of the fuzz test is here; the longer one in
tests/e2e/test_untrusted_trace_e2e.py. The rows of the issue's table are each one test below."""
from __future__ import annotations

import os
import resource
import tempfile
import tracemalloc
import zlib
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replaydiff.trace.format import pack_frame, read_frame

from untrusted_trace_helpers import (FRAME_FLAG_ZSTD, check_run, copy_of, deep, fuzz_once, record_small, run_verb,
                                     verbs)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return record_small(tmp_path_factory.mktemp("untrusted") / "t")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_crafted_and_damaged_files_of_every_kind_give_exit_0_1_or_3_and_one_line(small, data):
    fuzz_once(small, data)


def _all_verbs(trace: Path, op: int, tmp: Path) -> list:
    return [run_verb(argv) for argv in verbs(trace, op, tmp / "journal")]


def _ops_chunk(trace: Path) -> Path:
    return trace / "rank0" / "ops" / "000000000.rdt"  # ops #0-#7


def _data_file(trace: Path) -> Path:
    return sorted((trace / "rank0" / "data").iterdir())[0]


@pytest.mark.parametrize("which,what", [("manifest", "link to /dev/zero"), ("data", "link to /dev/zero"),
                                        ("ops", "link to /dev/zero"), ("ops", "FIFO"), ("index", "FIFO")])
def test_a_file_that_is_not_a_regular_file_is_refused_naming_it(small, tmp_path, which, what):
    """Every verb exits 3 and names the file, at once and in little memory: nothing is read through a link or from
    a FIFO (which would block the reader), however the trace names it."""
    trace = copy_of(small, tmp_path)
    path = {"manifest": trace / "rank0" / "manifest.rdt", "ops": _ops_chunk(trace), "data": _data_file(trace),
            "index": trace / "rank0" / "index.rdt"}[which]
    path.unlink()
    if what == "FIFO":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    tracemalloc.start()
    try:
        runs = _all_verbs(trace, 3, tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for ran in runs:
        check_run(ran, trace)
        if which == "data" and "--op" in ran.argv:
            continue  # prints the op's record: it reads no tensor data
        # show --list reads the index alone: it finds a data file's bytes missing and sends to show for which
        said = "is damaged: " if which == "data" and "--list" in ran.argv else str(path)
        assert ran.code == 3 and said in ran.stdout + ran.stderr, (ran.argv, ran.stdout, ran.stderr)
        assert ran.seconds < 20
    assert peak < 64 << 20, peak


@pytest.mark.parametrize("streamed", [False, True])
def test_a_small_zstd_frame_that_decompresses_to_much_more_is_refused_in_bounded_memory(small, tmp_path, streamed):
    """A 2 KB frame of 64 MiB of zeros: refused before allocating what its header claims, or (a frame that does not
    claim a size) once it passes the limit."""
    trace = copy_of(small, tmp_path)
    zeros = b"\x00" * (64 << 20)
    c = zstandard.ZstdCompressor(level=1)
    if streamed:
        obj = c.compressobj()
        payload = obj.compress(zeros) + obj.flush()
        assert zstandard.frame_content_size(payload) == -1
    else:
        payload = c.compress(zeros)
    assert len(payload) < 16 << 10
    path = trace / "rank0" / "manifest.rdt"
    path.write_bytes(b"RDT\x01" + bytes([FRAME_FLAG_ZSTD]) + zlib.crc32(payload).to_bytes(4, "little")
                     + len(payload).to_bytes(8, "little") + payload)
    tracemalloc.start()
    try:
        runs = _all_verbs(trace, 3, tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for ran in runs:
        check_run(ran, trace)
        assert ran.code == 3 and f"{path}: corrupt (" in ran.stderr, ran.stderr
    assert peak < 40 << 20, peak  # at most the frame limit's 16 MiB (and its copy), never the 64 MiB claimed


def _edit_manifest(trace: Path, **entries) -> Path:
    path = trace / "rank0" / "manifest.rdt"
    path.write_bytes(pack_frame({**read_frame(path), **entries}, None))
    return path


def _edit_op(trace: Path, op: int, key: str, value) -> Path:
    """Op ``op`` (of the first chunk) with ``key`` set to ``value``, its chunk framed anew with a good checksum and
    the manifest told its new size: a crafted trace, not a damaged one."""
    path = _ops_chunk(trace)
    frame = read_frame(path)
    frame["ops"][op][key] = value
    path.write_bytes(pack_frame(frame, None))
    m = read_frame(trace / "rank0" / "manifest.rdt")
    m["ops_files"][0][2] = path.stat().st_size
    m["data_bytes"] = sum(p.stat().st_size for d in ("ops", "data") for p in (trace / "rank0" / d).iterdir())
    (trace / "rank0" / "manifest.rdt").write_bytes(pack_frame(m, None))
    return path


@pytest.mark.parametrize("entry", [{"rank": "zero"}, {"world_size": "two"}, {"lost": 5}, {"ops_files": [[0, 1]]}])
def test_a_manifest_entry_of_the_wrong_type_is_refused_naming_the_manifest(small, tmp_path, entry):
    trace = copy_of(small, tmp_path)
    path = _edit_manifest(trace, **entry)
    for ran in _all_verbs(trace, 3, tmp_path):
        check_run(ran, trace)
        (key,) = entry
        assert ran.code == 3 and f"{path}: malformed manifest (manifest entry {key!r} " in ran.stderr, ran.stderr


@pytest.mark.parametrize("key,value,says", [
    ("a", [deep(400)], "nested more than"),  # wire-ok: damages a record on purpose
    ("a", [{"dt": "__class__", "sh": [2], "st": [1], "of": 0, "T": 1}],  # wire-ok: damages a record on purpose
     "a tensor of dtype '__class__'"),
    ("a", [{"device": "nonsense:99"}], "device 'nonsense:99'"),
    ("k", [1], "field 'k' is list"),
    ("coll", {"ranks": 5}, "a collective"),
    ("rng", {"dev": 1}, "a generator state"),
])
def test_an_op_field_of_the_wrong_type_is_refused_naming_the_ops_file(small, tmp_path, key, value, says):
    trace = copy_of(small, tmp_path)
    path = _edit_op(trace, 3, key, value)
    runs = _all_verbs(trace, 3, tmp_path)
    for ran in runs:
        check_run(ran, trace)
    for ran in [runs[0], *runs[2:]]:  # show, show --op 3, replay, diff read the record (--list reads the index)
        assert ran.code == 3 and str(path) in ran.stdout + ran.stderr and says in ran.stdout + ran.stderr, \
            (ran.argv, ran.stdout[-400:], ran.stderr)


@pytest.mark.parametrize("name", ["aten.mm.__class__", "__class__.__init__.__call__"])
def test_an_op_name_resolves_only_to_a_registered_op(small, tmp_path, name):
    """An op named after an attribute that is not an op overload is an op this torch does not have: shown without a
    schema, never looked up further, never called."""
    trace = copy_of(small, tmp_path)
    _edit_op(trace, 3, "op", name)  # wire-ok: damages a record on purpose
    shown, replayed = (run_verb(argv) for argv in verbs(trace, 3, tmp_path / "journal")[2:4])
    check_run(replayed, trace)
    assert shown.code == 0 and f"op #3 {name}" in shown.stdout and "schema" not in shown.stdout, shown.stdout
    # an op that held numbers and could not be run is not judged, and a replay with one is never clean
    assert replayed.code == 1 and "not judged" in replayed.stdout, (replayed.stdout[-600:], replayed.stderr)


def test_show_says_damaged_for_a_bit_flipped_ops_chunk_or_data_file(small, tmp_path):
    for which in ("ops", "data"):
        trace = copy_of(small, tmp_path / which)
        path = _ops_chunk(trace) if which == "ops" else _data_file(trace)
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0x10  # in the payload of the chunk, in the last stored bytes of the data file
        path.write_bytes(bytes(raw))
        ran = run_verb(["show", str(trace)])
        assert ran.code == 3, ran.stdout
        assert f"rank 0: 35 ops (DAMAGED: {path}: corrupt (" in ran.stdout and "checksum mismatch" in ran.stdout, \
            ran.stdout
        assert "complete" not in ran.stdout
        js = run_verb(["show", str(trace), "--json"])
        assert js.code == 3 and str(path) in js.stdout


def test_show_says_a_partial_trace_is_partial_and_exits_3(small, tmp_path):
    trace = copy_of(small, tmp_path)
    _edit_manifest(trace, complete=False)
    ran = run_verb(["show", str(trace)])
    assert ran.code == 3 and "TRUNCATED after op 34" in ran.stdout and "truncated after op 34" in ran.stderr
    listed = run_verb(["show", str(trace), "--list"])
    assert listed.code == 3 and "the trace is partial: rank 0's recording stopped part-way after op #34" in \
        listed.stderr, listed.stderr
