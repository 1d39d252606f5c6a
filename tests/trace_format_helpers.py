"""What tests/integration/test_trace_format.py and tests/e2e/test_trace_format_e2e.py share: a tensor's bits."""
from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
