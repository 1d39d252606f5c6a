"""The health report of the 2-rank DDP step whose all-reduce is corrupted on rank 1 (the rest:
tests/integration/test_health_report.py)."""
from __future__ import annotations

import re

from health_report_helpers import _causes, _replay_json, _report


def test_collective_disagreeing_across_ranks_is_named_with_its_rank(ddp_step_with_rank1_allreduce_fault, tmp_path,
                                                                    capsys):
    trace = ddp_step_with_rank1_allreduce_fault  # shared: the replay's JSON goes into tmp_path, not beside it
    md = _report(trace, _replay_json(trace, into=tmp_path), capsys)
    assert "a collective that disagrees across ranks" in _causes(md)
    ev = md.split("### a collective that disagrees across ranks", 1)[1]
    assert "rank 1 #" in ev and "c10d.allreduce_.default" in ev and "on rank(s) [1]" in ev
    assert re.search(r"\| collectives consistent across ranks \| 1 of \d+ disagree \| 0 \| FAIL \|", md)
