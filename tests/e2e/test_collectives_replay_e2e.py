"""A 2-rank gloo DDP step recorded with rank 1's all-reduce corrupted: replay names it on that rank only (the checks
of each kind, without processes, are tests/integration/test_collectives_replay.py)."""
from __future__ import annotations

from pathlib import Path

from replaydiff.replay import ReplayOptions, Status, replay_trace


def test_corrupted_allreduce_is_named_on_its_rank_only(ddp_step_with_rank1_allreduce_fault: Path) -> None:
    trace = ddp_step_with_rank1_allreduce_fault
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
