"""What tests/integration/test_read_api.py and tests/e2e/test_read_api_e2e.py share: a tiny transformer step recorded
once per module."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import replaydiff
from replaydiff.models.tiny import TinyTransformer, TransformerConfig, make_step


SMALL = TransformerConfig(vocab=32, d_model=16, heads=2, layers=2, seq=8, batch=2)


def _tiny_step():
    torch.manual_seed(0)
    model = TinyTransformer(SMALL)
    return make_step(model, model.example_batch(), torch.optim.AdamW(model.parameters(), lr=1e-3))


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("api") / "trace"
    step = _tiny_step()
    with replaydiff.record(path):
        step()
    return path
