"""What tests/integration/test_compiled.py and tests/e2e/test_compiled_e2e.py share: op names of a trace and a
fresh dynamo for every test."""
from __future__ import annotations

import pytest
import torch

from replaydiff.trace import open_trace


def trace_ops(path) -> list[str]:
    return [op.name for op in open_trace(path).rank(0)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    from replaydiff.record import compiled as compiled_mod

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    if compiled_mod._active:  # a failed test left a tracker started: do not let its patches leak into other tests
        compiled_mod._active.clear()
        compiled_mod._uninstall()
