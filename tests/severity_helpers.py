"""What tests/integration/test_severity.py and tests/e2e/test_severity_e2e.py share: a batch-norm step with an
ill-conditioned op, its traces (clean and planted) and their replays."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replaydiff
from replaydiff.replay import ReplayOptions, Status, replay_trace


PLANT = "aten.addmm.default:2:1e-3"  # the output layer's forward matmul


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x))))


def _step() -> None:
    torch.manual_seed(0)
    model = BNNet()
    x, y = torch.randn(256, 8), torch.randn(256, 4)  # a large batch: the bias gradient cancels the more
    F.mse_loss(model(x), y).backward()


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("severity")
    with replaydiff.record(root / "clean"):
        _step()
    with replaydiff.record(root / "planted", plant=PLANT):
        _step()
    return {"clean": root / "clean", "planted": root / "planted"}


@pytest.fixture(scope="module")
def reports(traces):
    return {k: replay_trace(str(p), ReplayOptions()) for k, p in traces.items()}


def _ill(report):
    """The ops replay calls ok although their error is over the fixed float32 limit."""
    return [r for r in report.ops if r.status is Status.OK and r.metrics and "norm_max" in r.metrics
            and r.metrics["norm_max"] > r.metrics["limit_max"]]
