"""The flight recorder triggers on what users watch: a loss that goes NaN/Inf while every gradient stays finite (the
value backward() starts from), a parameter made NaN by the update; at a normal exit it keeps the last K whole
steps. The trace it writes holds the steps before, and trend names the op that made the non-finite value."""
from __future__ import annotations

import math

import torch

import replaydiff
from replaydiff.trace import open_trace
from replaydiff.trend.analysis import compute_trend


def _train(steps: int, loss_nan_at: int = 0, lr_nan_at: int = 0) -> float:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    last = 0.0
    for step in range(1, steps + 1):
        loss = net(torch.randn(8, 4)).pow(2).mean()
        if step == loss_nan_at:  # a NaN no gradient carries: log(0) * 0 added as a constant
            loss = loss + torch.log(torch.zeros(())) * 0.0
        loss.backward()
        if step == lr_nan_at:
            opt.param_groups[0]["lr"] = float("nan")
        opt.step()
        opt.zero_grad()
        last = loss.item()  # an op after the step: no step of its own
    return last


def test_a_nan_loss_with_finite_gradients_dumps_the_steps_before_and_trend_names_the_op(tmp_path):
    with replaydiff.record(tmp_path / "t", tensors="stats", flight=8):
        last = _train(30, loss_nan_at=12)
    assert math.isfinite(last)  # training went on after step 12, unchanged
    r = open_trace(tmp_path / "t").rank(0)
    assert r.complete
    assert sorted({op.step for op in r}) == list(range(5, 13))
    assert "the loss" in r.flight.reason and "step 12" in r.flight.reason
    change = compute_trend(r).first_change
    assert change is not None and change.step == 12
    made = r[change.index]
    assert (made.step, made.name, made.phase) == (12, "aten.log.default", "forward")


def test_a_parameter_made_nan_by_the_update_dumps(tmp_path):
    with replaydiff.record(tmp_path / "t", tensors="stats", flight=3):
        _train(10, lr_nan_at=6)
    r = open_trace(tmp_path / "t").rank(0)
    assert sorted({op.step for op in r}) == [4, 5, 6]
    assert "after step 6" in r.flight.reason and "parameter" in r.flight.reason


def test_flight_at_exit_keeps_the_last_k_whole_steps(tmp_path):
    with replaydiff.record(tmp_path / "t", tensors="stats", flight=8, flight_at_exit=True):
        _train(20)
    r = open_trace(tmp_path / "t").rank(0)
    assert sorted({op.step for op in r}) == list(range(13, 21))
