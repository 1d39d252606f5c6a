"""The committed fixture trace (fixtures/regenerate.py) still reads and replays to its planted culprit."""
from __future__ import annotations

import json
from pathlib import Path

from replaydiff import open_trace
from replaydiff.replay import ReplayOptions, Status, replay_trace

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def test_committed_trace_replays_to_its_planted_op() -> None:
    expected = json.loads((FIXTURES / "mlp-fault.json").read_text())
    report = replay_trace(str(FIXTURES / expected["trace"]), ReplayOptions())
    divergent = [r for r in report.ops if r.status is Status.DIVERGENT]
    assert [(r.index, r.op) for r in divergent] == [(expected["planted_index"], expected["op"])]
    assert divergent[0].phase == expected["phase"] and divergent[0].module == expected["module"]
    assert report.counts()["error"] == 0


def test_committed_trace_is_complete_and_small() -> None:
    reader = open_trace(FIXTURES / "mlp-fault").rank(0)
    assert reader.complete and reader.truncated_after is None and reader.lost == []
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert total < 1 << 20


def test_iter_from_reads_the_tail_only() -> None:
    reader = open_trace(FIXTURES / "mlp-fault").rank(0)
    every = [op.index for op in reader]
    assert [op.index for op in reader.iter_from(40)] == [i for i in every if i >= 40]
    assert [op.index for op in reader.iter_from(0)] == every
