"""What the tests that start processes share: the environment a recorded job or a ``python -m replaydiff`` child runs
in."""
from __future__ import annotations

import os
import sys


def child_env() -> dict:
    """This process's environment without the launcher's rank variables or a recording request inherited from the
    test run, and with this interpreter's folder first on PATH (so ``torchrun`` and ``python`` are this venv's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "REPLAYDIFF_RECORD")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env
