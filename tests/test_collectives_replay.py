"""Collectives are checked across ranks: a corrupted all-reduce on one rank is named, the other rank's is not."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from replaydiff.replay import ReplayOptions, Status, replay_trace

SCRIPT = textwrap.dedent('''
    import sys, torch, torch.distributed as dist
    from replaydiff import record
    from replaydiff.faults import PlantedFault
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters())
    torch.manual_seed(dist.get_rank())
    x = torch.randn(4, 8)
    fault_rank = int(sys.argv[2])
    with PlantedFault("c10d.allreduce_.default", rel=1e-3, rank=fault_rank), record(sys.argv[1]):
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        t = torch.arange(3, dtype=torch.float32) + dist.get_rank()
        dist.all_reduce(t)
        out = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(out, torch.ones(2) * dist.get_rank())
    dist.barrier()  # gloo aborts a rank that destroys its group while the other still talks to it
    dist.destroy_process_group()
''')


def _run(tmp_path: Path, fault_rank: int) -> Path:
    script = tmp_path / "ddp_step.py"
    script.write_text(SCRIPT)
    trace = tmp_path / "trace"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    subprocess.run(torchrun + [str(script), str(trace), str(fault_rank)], check=True, capture_output=True,
                   timeout=120)
    return trace


@pytest.mark.slow
def test_corrupted_allreduce_is_named_on_its_rank_only(tmp_path: Path) -> None:
    trace = _run(tmp_path, fault_rank=1)
    report = replay_trace(str(trace), ReplayOptions())
    divergent = [r for r in report.ops if r.status is Status.DIVERGENT]
    assert [(r.rank, r.op) for r in divergent] == [(1, "c10d.allreduce_.default")]
    assert "float64 sum of all ranks' inputs" in divergent[0].reason
    checked = [r for r in report.ops if r.op.startswith("c10d.") and r.status is Status.OK]
    # rank 0's gradient all-reduce, both user all-reduces, both all-gathers (and DDP's broadcasts) passed the check
    assert {(r.rank, r.op) for r in checked} >= {(0, "c10d.allreduce_.default"), (1, "c10d.allreduce_.default"),
                                                (0, "c10d.allgather_.default"), (1, "c10d.allgather_.default")}
    assert all("checked across ranks" in r.reason for r in checked)
    assert report.counts()["error"] == 0
