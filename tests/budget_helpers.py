"""What tests/integration/test_budget.py and tests/e2e/test_budget_e2e.py share: bytes on disk and the op numbers a
line names."""
from __future__ import annotations

import re
from pathlib import Path


def _bytes_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _named_ops(line: str) -> tuple[set[int], int]:
    """The op numbers a line's "N op(s) (#a-#b, #c ...)" names, and N; a shortened list ("and K more runs up to
    #L") adds only its last op."""
    m = re.search(r"(\d+) op\(s\) \(([^)]*)\)", line)
    assert m, line
    named = set()
    for part in re.findall(r"#(\d+)(?:-#(\d+))?", m.group(2)):
        named |= set(range(int(part[0]), int(part[1] or part[0]) + 1))
    return named, int(m.group(1))
