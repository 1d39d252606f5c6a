"""What tests/integration/test_diff.py and tests/e2e/test_diff_e2e.py share: the number of an op in a trace."""
from __future__ import annotations

from pathlib import Path

import replay_helpers as rh


def _index(path: Path, name: str, occurrence: int = 0, rank: int = 0) -> int:
    return rh.occurrence_index(rh.trace_ops(path, rank), name, occurrence)
