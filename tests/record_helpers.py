"""What tests/integration/test_record.py and tests/e2e/test_record_e2e.py share: the one op of a name, and what an op
wrote."""
from __future__ import annotations

from replaydiff.trace import OpRecord


def only(ops: list[OpRecord], name: str) -> OpRecord:
    found = [o for o in ops if o.name == name]
    assert len(found) == 1, f"expected one {name}, found {len(found)}: {[o['op'] for o in ops]}"
    return found[0]


def written(op: OpRecord) -> dict:
    """path (ArgPath, a tuple such as ("arg", 0)) -> after-value reference(s)."""
    return {path: after for path, after in op.writes}
