"""The read API where it takes a process or many examples: the documented example run as written, ``show --op
--json`` and malformed records (the rest: tests/integration/test_read_api.py)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import replaydiff

from read_api_helpers import tiny_trace  # noqa: F401 (tiny_trace: a fixture)


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc,heading", [("docs/trace-format.md", "# Reading a trace from Python")])
def test_readme_example_runs_as_written(tiny_trace: Path, tmp_path: Path, doc: str, heading: str) -> None:
    text = (ROOT / doc).read_text()
    section = text[text.index(heading):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "trace").symlink_to(tiny_trace)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "aten.mm.default" in out.stdout


def test_show_op_json_is_the_typed_record(tiny_trace: Path) -> None:
    r = replaydiff.open_trace(tiny_trace).rank(0)
    mm = next(op for op in r if op.name == "aten.mm.default")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "replaydiff", "show", str(tiny_trace), "--op", str(mm.index),
                          "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["format"] == "replaydiff.op/1" and d["index"] == mm.index and d["name"] == "aten.mm.default"
    assert d["args"][0]["tensor"]["shape"] == list(mm.args[0].shape)
    assert {int(k): v for k, v in d["producers"].items()} == r.producers(mm.index)


def test_a_well_framed_but_malformed_record_is_a_trace_error(tmp_path: Path) -> None:
    from replaydiff.trace.format import pack_frame, read_frame, write_atomic

    x = torch.ones(3)
    with replaydiff.record(tmp_path / "t"):
        x.mul(2)
    chunk = tmp_path / "t" / "rank0" / "ops" / "000000000.rdt"
    frame = read_frame(chunk)
    # the checksum is right (re-packed), the content is not
    frame["ops"][0]["a"][1] = {"bogus": 1}  # wire-ok: damages a record on purpose
    write_atomic(chunk, pack_frame(frame, 1))
    # as a trace whose manifest lists no ops files would be (else the chunk's new size alone names it damaged)
    manifest_path = tmp_path / "t" / "rank0" / "manifest.rdt"
    manifest = read_frame(manifest_path)
    del manifest["ops_files"]  # wire-ok: damages a record on purpose
    write_atomic(manifest_path, pack_frame(manifest, None))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for verb in (["replay", str(tmp_path / "t")], ["show", str(tmp_path / "t"), "--op", "0"]):
        out = subprocess.run([sys.executable, "-m", "replaydiff", *verb], capture_output=True, text=True, env=env,
                             timeout=120)
        assert out.returncode == 3, out.stderr
        assert out.stderr.count("\n") == 1 and "000000000.rdt" in out.stderr and "malformed" in out.stderr
