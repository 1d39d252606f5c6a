"""Shared fixtures: a seeded tiny-transformer training step, and recording one step into tmp_path."""
from __future__ import annotations

import pytest
import torch

import replaydiff
from replaydiff.models.tiny import TinyTransformer, make_step
from replaydiff.trace import open_trace


def pytest_collection_modifyitems(config, items):
    """Deselect tests marked ``gpu`` on a machine without CUDA (the marker's documented meaning)."""
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]


@pytest.fixture
def tiny_step():
    """One training step (forward, backward, AdamW) of TinyTransformer built under torch.manual_seed(0).

    The closure returns the loss; ``.model``, ``.optimizer`` and ``.batch`` are attached to it."""
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = model.example_batch()
    step = make_step(model, batch, optimizer)
    step.model, step.optimizer, step.batch = model, optimizer, batch
    return step


@pytest.fixture
def record_one(tmp_path):
    """record_one(fn, name="trace", **options) -> (fn's result, RankTrace of rank 0): ``fn()`` run while recorded
    into ``tmp_path/name``."""

    def run(fn, name: str = "trace", **options):
        path = tmp_path / name
        with replaydiff.record(path, **options):
            result = fn()
        return result, open_trace(path).rank(0)

    return run
