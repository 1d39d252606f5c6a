"""What tests/integration/test_untrusted_trace.py and tests/e2e/test_untrusted_trace_e2e.py share: a small trace,
mutations of its files as someone crafting or damaging one would make them (bit flips, cuts, random msgpack, values
of the wrong type), and the verbs that read a trace run through the CLI's ``main()`` in this process."""
from __future__ import annotations

import contextlib
import io
import json
import resource
import shutil
import struct
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

import replaydiff
from replaydiff.cli.main import main
from replaydiff.trace.format import pack_frame, read_frame

FRAME_FLAG_ZSTD = 1  # byte 4 of a frame's header (trace/format.py)


def record_small(path: Path) -> Path:
    """A 35-op training step of a tiny MLP, in 5 ops chunks and 4 data files."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with replaydiff.record(path, chunk_ops=8):
        model(torch.randn(3, 4)).square().mean().backward()
    return path


def trace_files(root: Path) -> dict[str, list[str]]:
    """The files of a trace by kind (paths relative to ``root``)."""
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    return {"manifest": [f for f in files if f.endswith("manifest.rdt")],
            "index": [f for f in files if f.endswith("index.rdt")],
            "ops": [f for f in files if "/ops/" in f],
            "data": [f for f in files if "/data/" in f]}


# -- values of every type msgpack holds, nested, for random frames and wrong types -----------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
                    st.text(max_size=12), st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                      max_leaves=12)


def deep(n: int) -> Any:
    v: Any = 1
    for _ in range(n):
        v = [v]
    return v


wrong_values = st.one_of(values, st.integers(0, 400).map(deep), st.just("zero"), st.just(-1), st.just(1 << 62),
                         st.just("aten.mm.__class__"), st.just({"dtype": "__class__"}), st.just([[1, 2, 3]]))
# the same for a safetensors header (JSON: no bytes, no NaN)
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12)),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                           max_leaves=12)
json_wrong_values = st.one_of(json_values, st.integers(0, 400).map(deep), st.just("zero"), st.just(-1),
                              st.just(1 << 62), st.just([[1, 2, 3]]))


def _paths(v: Any, at: tuple = ()) -> list[tuple]:
    """Every place in a decoded frame a value sits (keys of maps, positions of lists), the root included."""
    out = [at]
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, at + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, at + (i,))
    return out


def _replace(v: Any, at: tuple, new: Any) -> Any:
    if not at:
        return new
    v[at[0]] = _replace(v[at[0]], at[1:], new)
    return v


def _safetensors_header(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _safetensors(header: Any, body: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body


@dataclass(frozen=True)
class Mutation:
    how: str  # flip, cut (damage), msgpack, types (crafted anew, framed with a good checksum)
    covered: bool  # it changed bytes that a checksum or a size the trace records covers: never clean


def mutate(data: st.DataObject, root: Path, kind: str, name: str) -> Mutation:
    """Change one file of the trace at ``root`` as ``data`` draws it."""
    path = root / name
    raw = bytearray(path.read_bytes())
    hows = ["flip", "cut", "types"] + (["msgpack"] if kind != "data" else [])
    how = data.draw(st.sampled_from(hows), label="how")
    covered = how == "cut"
    if how == "flip":  # sampled_from spreads positions over the whole file (integers favours its first bytes)
        at = data.draw(st.sampled_from(range(len(raw))), label="position")
        raw[at] ^= data.draw(st.integers(1, 255), label="xor")
        path.write_bytes(bytes(raw))
        # a frame is covered whole (header fields checked, payload by its CRC); a data file's stored bytes are, but
        # not its JSON header (a space turned into a tab there changes nothing)
        covered = kind != "data" or at >= 8 + struct.unpack("<Q", raw[:8])[0]
    elif how == "cut":
        path.write_bytes(bytes(raw[:data.draw(st.sampled_from(range(len(raw))), label="length")]))
    elif how == "msgpack":
        path.write_bytes(pack_frame(data.draw(values, label="frame"), 1 if raw[4] & FRAME_FLAG_ZSTD else None))
    elif kind == "data":  # a value of the wrong type somewhere in the safetensors header
        header, body = _safetensors_header(bytes(raw))
        at = data.draw(st.sampled_from(_paths(header)), label="at")
        new = data.draw(json_wrong_values, label="value")
        path.write_bytes(_safetensors(_replace(header, at, new), body))
    else:  # a value of the wrong type somewhere in the frame, framed anew with a good checksum
        frame = read_frame(path)
        at = data.draw(st.sampled_from(_paths(frame)), label="at")
        path.write_bytes(pack_frame(_replace(frame, at, data.draw(wrong_values, label="value")),
                                    1 if raw[4] & FRAME_FLAG_ZSTD else None))
    if how in ("msgpack", "types") and kind == "ops":
        _sizes_as_on_disk(root)  # so the crafted chunk is read, not only found not as written
    return Mutation(how, covered)


def _sizes_as_on_disk(root: Path) -> None:
    """Make the manifest agree with the ops chunks' sizes on disk (as someone crafting a trace would)."""
    for rank_dir in root.iterdir():
        m = read_frame(rank_dir / "manifest.rdt")
        for entry in m.get("ops_files") or []:
            entry[2] = (rank_dir / "ops" / f"{entry[0]:09d}.rdt").stat().st_size
        m["data_bytes"] = sum(p.stat().st_size for d in ("ops", "data") for p in (rank_dir / d).iterdir())
        (rank_dir / "manifest.rdt").write_bytes(pack_frame(m, None))


@dataclass(frozen=True)
class Ran:
    argv: list[str]
    code: Any  # the exit code, or the exception that escaped main()
    stdout: str
    stderr: str
    seconds: float


def run_verb(argv: list[str]) -> Ran:
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code: Any = main(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - what the test asserts never happens
        code = traceback.format_exc()
    return Ran(argv, code, out.getvalue(), err.getvalue(), time.monotonic() - start)


def verbs(trace: Path, op: int, journal: Path) -> list[list[str]]:
    """Every verb that reads a trace, as a user runs it on one received."""
    t = str(trace)
    return [["show", t], ["show", t, "--list"], ["show", t, "--op", str(op)],
            ["replay", t, "--journal", str(journal)], ["diff", t, t]]


def check_run(ran: Ran, trace: Path) -> None:
    """Exit 0, 1 or 3; no traceback; at most one error line, naming a file of the trace; within time."""
    assert isinstance(ran.code, int), f"{ran.argv}: {ran.code}"
    assert ran.code in (0, 1, 3), (ran.argv, ran.code, ran.stderr)
    assert "Traceback" not in ran.stderr, (ran.argv, ran.stderr)
    errors = [line for line in ran.stderr.splitlines() if line.startswith("replaydiff: error:")]
    assert len(errors) <= 1, (ran.argv, ran.stderr)
    if ran.code == 3 and errors:
        assert str(trace) in errors[0], (ran.argv, errors)
    assert ran.seconds < 60, (ran.argv, ran.seconds)


def copy_of(trace: Path, tmp: Path) -> Path:
    copy = tmp / "t"
    shutil.copytree(trace, copy)
    return copy


def fuzz_once(small: Path, data: st.DataObject) -> None:
    """One file of ``small`` changed as ``data`` draws it, then every verb run on the copy."""
    files = trace_files(small)
    kind = data.draw(st.sampled_from(sorted(k for k in files if files[k])), label="kind")
    name = data.draw(st.sampled_from(files[kind]), label="file")
    op = data.draw(st.integers(0, 34), label="op")
    with tempfile.TemporaryDirectory() as tmp:
        copy = copy_of(small, Path(tmp))
        m = mutate(data, copy, kind, name)
        for argv in verbs(copy, op, Path(tmp) / "journal"):
            ran = run_verb(argv)
            check_run(ran, copy)
            # show (the summary), replay and diff read every file: bytes that fail their checksum are never clean
            if m.covered and argv[0] != "show" or m.covered and len(argv) == 2:
                assert ran.code != 0, (m, name, argv, ran.stdout[-300:])
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 4 << 20  # KiB: never gigabytes
