"""The library and CLI never import the TUI or textual: a recorder runs inside training jobs and must stay light."""
from __future__ import annotations

import subprocess
import sys


def test_replaydiff_imports_without_textual_or_tui() -> None:
    code = ("import sys, replaydiff, replaydiff.cli.main, replaydiff.replay, replaydiff.trace; "
            "replaydiff.cli.main.build_parser(); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'textual' or m.startswith('replaydiff.tui')); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
