"""Point-to-point sends and receives (pipeline stages) under torchrun: recording them leaves the job running (gloo's
works count their waits: the recorder waits once and hands the job a completed work), replay pairs each send with
its receive and names a receive that got other values than were sent, and diff against the single process refuses
pipeline stages in one line instead of mapping them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from replaydiff.cli.main import main
from replaydiff.replay import ReplayOptions, replay_trace
from replaydiff.trace import open_trace

pytestmark = pytest.mark.slow

PIPELINE = r'''
import os, sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import replaydiff

out, fault = Path(sys.argv[1]), sys.argv[2] == "fault"
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))


class CorruptReceive(TorchDispatchMode):
    """Below the recorder: rank 1's received activations come out 1e-3 larger (a bad transport)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.c10d.recv_.default:
            out.wait()
            args[0][0].add_(1e-3)
            from torch._C._distributed_c10d import _create_work_from_future
            done = torch.futures.Future()
            done.set_result(None)
            return _create_work_from_future(done).boxed()
        return out


if world > 1:
    dist.init_process_group("gloo")
torch.manual_seed(0)
stages = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2)])
x = torch.randn(8, 4)
below = CorruptReceive() if fault and rank == 1 else None
if below is not None:
    below.__enter__()
with replaydiff.record(out):
    for micro in range(2):
        if world == 1:
            stages[1](torch.relu(stages[0](x))).square().mean().backward()
        elif rank == 0:
            h = torch.relu(stages[0](x)).detach()
            dist.send(h, dst=1)
        else:
            h = torch.empty(8, 4)
            dist.recv(h, src=0)
            stages[1](h).square().mean().backward()
if below is not None:
    below.__exit__(None, None, None)
if world > 1:
    dist.destroy_process_group()
print("finished")
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("p2p")
    script = d / "pipeline.py"
    script.write_text(PIPELINE)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = {}
    for name, cmd in (("single", [sys.executable]), ("pipe", torchrun), ("fault", torchrun)):
        out[name] = d / name
        proc = subprocess.run(cmd + [str(script), str(out[name]), name], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr[-2000:]
    return out


def test_a_recorded_pipeline_finishes_and_each_send_is_judged_against_its_receive(runs):
    report = replay_trace(str(runs["pipe"]), ReplayOptions())
    p2p = [r for r in report.ops if r.op in ("c10d.send.default", "c10d.recv_.default")]
    assert [(r.rank, r.op) for r in p2p] == [(0, "c10d.send.default")] * 2 + [(1, "c10d.recv_.default")] * 2
    assert {str(r.status) for r in p2p} == {"ok"} and report.first_divergent is None


def test_a_receive_that_got_other_values_than_were_sent_is_the_culprit(runs):
    trace = open_trace(runs["fault"])
    first_recv = next(op.index for op in trace.rank(1) if op.name == "c10d.recv_.default")
    culprit = replay_trace(str(runs["fault"]), ReplayOptions()).first_divergent
    assert (culprit.rank, culprit.index, culprit.op) == (1, first_recv, "c10d.recv_.default")


def test_diff_against_the_single_process_refuses_pipeline_stages_in_one_line(runs, capsys):
    assert main(["diff", str(runs["single"]), str(runs["pipe"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "point to point: pipeline stages" in err[0] and "#" in err[0]
