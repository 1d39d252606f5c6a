"""The trace format against a killed writer and many damaged traces (the rest:
tests/integration/test_trace_format.py)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import replaydiff
from replaydiff.errors import TraceError
from replaydiff.trace import OpRecord, TensorRef, iter_refs, open_trace
from replaydiff.trace.format import MANIFEST

from trace_format_helpers import bits


def all_refs(op: OpRecord) -> list[TensorRef]:
    return list(iter_refs([op.args, list(op.kwargs.values()), [after for _, after in op.writes], op.outputs]))


# -- a process killed mid-step -----------------------------------------------------------------------------------
KILLED_CHILD = textwrap.dedent("""
    import os, signal, sys
    import torch
    import replaydiff
    from replaydiff.models.tiny import TinyTransformer, TransformerConfig, make_step

    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig(d_model=32, heads=2, layers=2, seq=16, batch=4))
    step = make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters()))

    def die(*_):
        print("killing myself in backward", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    model.blocks[0].register_full_backward_hook(die)  # fires in the middle of the backward pass
    with replaydiff.record(sys.argv[1], chunk_ops=16):
        step()
    print("survived", flush=True)
""")


def test_trace_of_a_killed_process_reads_up_to_its_last_chunk(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(KILLED_CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "REPLAYDIFF_RECORD")}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "t")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "killing myself in backward" in proc.stdout and "survived" not in proc.stdout
    r = open_trace(tmp_path / "t").rank(0)
    assert r.complete is False and r.manifest["complete"] is False
    last = r.truncated_after
    assert isinstance(last, int) and last >= 0
    ops = list(r)
    assert [o.index for o in ops] == list(range(last + 1))
    for i in range(last + 1):
        op = r.op(i)
        for ref in all_refs(op):
            if ref.stored:
                t = r.tensor(ref)
                assert tuple(t.shape) == ref.shape
    assert ops[0].phase == "forward"


# -- damaged traces: the original data or a TraceError, nothing else ---------------------------------------------
@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    root = tmp_path_factory.mktemp("damage") / "t"
    g = torch.Generator().manual_seed(0)
    # Big enough that tensor bytes, not headers, make up most of each data file.
    x, w = torch.randn(64, 24, generator=g), torch.randn(24, 16, generator=g)
    torch.manual_seed(0)
    with replaydiff.record(root, chunk_ops=4):
        h = (x @ w).relu()
        d = F.dropout(h, 0.3, training=True)
        h.add_(1)
        s = d.sum() + h.mean()
        idx = torch.arange(5).mul(3)
        mask = (x > 0).logical_not()
        s.add(idx.sum()).mul(mask.sum())
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    kinds = {"manifest": [f for f in files if f.endswith(MANIFEST)],
             "ops": [f for f in files if "/ops/" in f], "data": [f for f in files if "/data/" in f]}
    assert all(len(v) >= 1 for v in kinds.values()) and len(kinds["ops"]) >= 3 and len(kinds["data"]) >= 2, kinds
    baseline = read_everything(root)
    assert any(o.rng is not None for o in open_trace(root).rank(0)) and baseline[0][1] is True
    return root, files, baseline


def record_fields(op: OpRecord) -> tuple:
    """Everything the typed record says: its JSON form, where each tensor's bytes are, its generator state."""
    return op.to_json(), [(ref.chunk, ref.nbytes) for ref in all_refs(op)], op.rng


def read_everything(root: Path):
    """Every byte a user of the trace can get at: manifests, op records, tensors, generator states."""
    out = {}
    for r in open_trace(root):
        ops = list(r)
        tensors = []
        for op in ops:
            for ref in all_refs(op):
                if ref.stored:
                    t = r.tensor(ref)
                    tensors.append((ref.version, str(t.dtype), tuple(t.shape), tuple(t.stride()), bits(t)))
            if op.rng is not None:
                tensors.append(("rng", bits(r.rng_state(op.rng))))
        idx = r.index  # read from index.rdt, or rebuilt from the chunks when that file is damaged
        index = [(idx.name[i], idx.phase[i], idx.module[i], idx.source[i], idx.forward[i], idx.output[i],
                  idx.recorded[i], idx.cheap[i], idx.collective[i], idx.random[i], r.producers(i), r.consumers(i))
                 for i in range(len(idx))]
        out[r.rank] = (r.manifest, r.complete, r.truncated_after, [record_fields(op) for op in ops], tensors, index)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_damaged_trace_reads_whole_or_raises_trace_error(small_trace, data):
    root, files, baseline = small_trace
    name = data.draw(st.sampled_from(files), label="file")
    how = data.draw(st.sampled_from(["flip", "cut"]), label="how")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "t"
        shutil.copytree(root, copy)
        target = copy / name
        raw = bytearray(target.read_bytes())
        # sampled_from spreads positions over the whole file (st.integers favours the first bytes: the headers).
        if how == "flip":
            pos = data.draw(st.sampled_from(range(len(raw))), label="position")
            raw[pos] ^= data.draw(st.integers(1, 255), label="xor")
        else:
            raw = raw[:data.draw(st.sampled_from(range(len(raw))), label="length")]
        target.write_bytes(bytes(raw))
        try:
            got = read_everything(copy)
        except TraceError as exc:
            assert str(exc).strip() and "\n" not in str(exc)
            return
        assert got == baseline
