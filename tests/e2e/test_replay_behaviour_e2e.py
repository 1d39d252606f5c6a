"""Replay of a trace whose recording was killed by SIGKILL mid-backward (the rest:
tests/integration/test_replay_behaviour.py)."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import replay_helpers as rh
from replaydiff import open_trace
from replaydiff.replay import Status


TESTS = Path(__file__).resolve().parents[1]


# -- a recording killed mid-backward ---------------------------------------------------------------------------
_KILLED_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch
    import replay_helpers as rh
    from replaydiff.models import TinyTransformer, make_step
    from replaydiff.record import record

    torch.manual_seed(0)
    model = TinyTransformer(rh.SMALL)
    step = make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters(), lr=1e-3))
    calls = []

    def kill_at_second_layer(module, grad_input, grad_output):
        calls.append(module)
        if len(calls) == 2:  # backward has gone through two transformer blocks
            os.kill(os.getpid(), signal.SIGKILL)

    for block in model.blocks:
        block.register_full_backward_hook(kill_at_second_layer)
    with record({out!r}, chunk_ops=16):
        step()
    sys.exit(3)  # never reached
""")


def test_trace_cut_by_sigkill_mid_backward_replays_its_prefix(tmp_path):
    out = tmp_path / "killed"
    script = tmp_path / "record_and_die.py"
    script.write_text(_KILLED_SCRIPT.format(tests=str(TESTS), out=str(out)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]

    reader = open_trace(out).rank(0)
    assert not reader.complete and reader.truncated_after is not None
    ops = list(reader)
    phases = [op.phase for op in ops]
    assert "forward" in phases and "backward" in phases and "optimizer" not in phases
    assert reader.truncated_after == ops[-1].index

    report = rh.replay_trace_uncached(out)
    assert [r.index for r in report.ops] == [op.index for op in ops]
    assert report.counts()["divergent"] == 0, rh.describe(rh.by_status(report, Status.DIVERGENT))
    assert report.counts()["error"] == 0, rh.describe(rh.by_status(report, Status.ERROR))
    assert any("truncated" in w for w in report.warnings), report.warnings
