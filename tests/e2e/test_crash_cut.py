"""A job killed mid-step leaves a trace that replays up to where it died: chunks are handed to the writer after
flush_seconds even while the job hangs inside an op, and SIGTERM (torchrun's way to stop the surviving ranks) flushes
what is recorded, then does what the process would have done without the recorder."""
from __future__ import annotations

import pytest
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import replaydiff
from replaydiff.replay import ReplayOptions, Status, replay_trace

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import signal, sys, time
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import replaydiff
from transformers import GPT2Config, GPT2LMHeadModel

class HangInBackward(TorchDispatchMode):
    # Below the recorder: the first backward op never returns, like a rank stuck in a collective.
    n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        if torch._C._current_autograd_node() is not None:
            print("HANG", self.n, flush=True)
            time.sleep(120)
        return func(*args, **(kwargs or {}))

if sys.argv[2] == "user-handler":
    def handler(signum, frame):
        print("user handler ran", flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, handler)
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
model = GPT2LMHeadModel(cfg)
ids = torch.randint(0, 64, (2, 8))
with HangInBackward(), replaydiff.record(sys.argv[1]):
    model(ids, labels=ids).loss.backward()
"""


def _start(trace: Path, mode: str = "plain") -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(trace), mode], stdout=subprocess.PIPE, text=True,
                            env=env)
    line = proc.stdout.readline()
    assert line.startswith("HANG"), line
    return proc, int(line.split()[1])


def _readable_prefix(trace: Path) -> int:
    r = replaydiff.open_trace(trace).rank(0)
    assert not r.complete and r.truncated_after is not None
    return r.truncated_after + 1


def test_sigkill_while_hung_in_backward_leaves_the_ops_before_it(tmp_path: Path) -> None:
    proc, hang_at = _start(tmp_path / "t")
    time.sleep(1.5)  # > flush_seconds (0.5 s): the writer thread hands the waiting chunk over by itself
    proc.kill()
    proc.wait(timeout=30)
    assert hang_at > 150
    assert _readable_prefix(tmp_path / "t") >= 150
    report = replay_trace(str(tmp_path / "t"), ReplayOptions())
    assert any("truncated after op" in w for w in report.warnings)
    assert report.counts()["divergent"] == 0 and report.counts()["error"] == 0
    assert sum(r.status is Status.OK for r in report.ops) > 100


def test_sigterm_flushes_then_dies_as_it_would_have(tmp_path: Path) -> None:
    proc, hang_at = _start(tmp_path / "t")
    proc.send_signal(signal.SIGTERM)  # at once: no timer flush has happened yet
    assert proc.wait(timeout=30) == -signal.SIGTERM  # the default action still ends the process
    assert _readable_prefix(tmp_path / "t") == hang_at - 1  # every op before the hung one
    r = replaydiff.open_trace(tmp_path / "t").rank(0)
    assert any("SIGTERM" in line for line in r.lost)


@pytest.mark.slow
def test_sigterm_chains_to_the_jobs_own_handler(tmp_path: Path) -> None:
    proc, hang_at = _start(tmp_path / "t", "user-handler")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 7
    assert proc.stdout.read().strip() == "user handler ran"
    assert _readable_prefix(tmp_path / "t") == hang_at - 1
