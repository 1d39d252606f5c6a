"""How much a score proves: a jump scored against few steps is weak evidence, outranked by a sounder change after it
(NaN/Inf appearing, or a jump the short history still cannot explain); a gradient shrinking as the run converges is
no change, a gradient cut by an order of magnitude or to zero is. Traces are recorded here from tiny loops."""
from __future__ import annotations

import json

import pytest
import torch

import replaydiff
from replaydiff.cli.main import main as cli_main
from replaydiff.trace import open_trace
from replaydiff.trend import MIN_HISTORY, compute_trend, sound_score
from steps_helpers import one_thread  # noqa: F401 (autouse: one intra-op thread, restored afterwards)


JUMP_STEP, NAN_STEP = 15, 17


def _flat_then_jump(path, factor: float, nan: bool) -> None:
    """The same batch every step and a learning rate too small to move the weights: every series is flat. At step
    JUMP_STEP the batch is ``factor`` times larger (a sum loss and bias-free layers: every output and gradient is
    ``factor`` times larger); with ``nan`` a NaN enters the batch at NAN_STEP. ``--flight 8``: steps 10..17 are
    written, so step 15 is scored against 5 steps (MIN_HISTORY)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with replaydiff.record(path, tensors="stats", flight=8, flight_at_exit=True):
        for step in range(1, NAN_STEP + 1):
            batch = x * factor if step == JUMP_STEP else x.clone()
            if nan and step == NAN_STEP:
                batch[0, 0] = float("nan")
            model(batch).sum().backward()
            opt.step()
            opt.zero_grad()


def test_a_weak_jump_against_five_steps_is_passed_over_for_a_nan_after_it(tmp_path, capsys):
    """4.5x on flat series scores 13.1 (over the threshold of 12) against 5 steps, under the 17 that so few need:
    the NaN two steps later is the first change, and the jump is said to have been passed over."""
    _flat_then_jump(tmp_path / "t", 4.5, nan=True)
    t = compute_trend(open_trace(tmp_path / "t").rank(0))
    assert t.steps == list(range(10, NAN_STEP + 1))
    c, w = t.first_change, t.passed_over
    assert c is not None and (c.step, c.statistic) == (NAN_STEP, "nan")
    assert w is not None and (w.step, w.statistic, w.history, w.sound) == (JUMP_STEP, "l2", MIN_HISTORY, False)
    assert t.threshold <= abs(w.score) < sound_score(t.threshold, MIN_HISTORY)
    assert cli_main(["trend", str(tmp_path / "t")]) == 1
    out = capsys.readouterr().out
    assert f"first change: step {NAN_STEP}, " in out
    assert f"an earlier jump, passed over for the sounder change after it: step {JUMP_STEP}, module " \
           f"{w.module}, op #{w.index} {w.op} ({w.phase}): l2 " in out
    assert f"(z = {w.score:g} against only {MIN_HISTORY} steps, where 17 is needed: weak evidence)" in out
    assert cli_main(["trend", str(tmp_path / "t"), "--json", "-"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["first_change"]["step"], doc["first_change"]["weak"]) == (NAN_STEP, False)
    assert (doc["passed_over"]["step"], doc["passed_over"]["history"], doc["passed_over"]["weak"]) == \
           (JUMP_STEP, MIN_HISTORY, True)


def test_a_weak_jump_is_still_the_first_change_where_nothing_sounder_follows(tmp_path, capsys):
    _flat_then_jump(tmp_path / "t", 4.5, nan=False)
    t = compute_trend(open_trace(tmp_path / "t").rank(0))
    c = t.first_change
    assert c is not None and (c.step, c.sound, c.history) == (JUMP_STEP, False, MIN_HISTORY) and t.passed_over is None
    assert cli_main(["trend", str(tmp_path / "t")]) == 1
    assert f"against only {MIN_HISTORY} steps, where 17 is needed: weak evidence)" in capsys.readouterr().out


def test_a_sound_jump_before_a_nan_stays_the_first_change(tmp_path):
    """20x scores 26 against the same 5 steps: sound, and it comes first."""
    _flat_then_jump(tmp_path / "t", 20, nan=True)
    t = compute_trend(open_trace(tmp_path / "t").rank(0))
    c = t.first_change
    assert c is not None and (c.step, c.statistic, c.sound) == (JUMP_STEP, "l2", True) and t.passed_over is None


GNN = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
N, E, D = 12, 30, 8


class MeanConv(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.self_lin = nn.Linear(d, d)

    def forward(self, x, src, dst):
        msg = self.lin(x)[src]
        agg = torch.zeros_like(x).index_add(0, dst, msg)
        deg = torch.zeros(x.shape[0]).scatter_add(0, dst, torch.ones(dst.shape[0]))
        agg = agg / deg.unsqueeze(1)  # 0/0 on a node without an incoming edge
        return F.relu(agg + self.self_lin(x))


class GNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = MeanConv(D)
        self.c2 = MeanConv(D)
        self.out = nn.Linear(D, 3)

    def forward(self, x, src, dst):
        return self.out(self.c2(self.c1(x, src, dst), src, dst))


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(N, D, generator=g)
    dst = torch.cat([torch.arange(N), torch.randint(0, N, (E - N,), generator=g)])
    src = torch.randint(0, N, (E,), generator=g)
    if step == 17:  # BUG: a bad batch, node 5 has no incoming edge
        dst[dst == 5] = 6
    return x, src, dst, torch.randint(0, 3, (N,), generator=g)


def train():
    model = GNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(1, 18):
        x, src, dst, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x, src, dst), y).backward()
        opt.step()
'''


def test_the_trial_gnn_names_the_division_that_made_nan_not_noise_two_steps_before(tmp_path):
    """A new user's job: a graph network whose mean aggregation divides 0 by 0 on a batch where a node has no edge
    (step 17). ``--flight 8`` keeps steps 10..17; a backward ``mm``'s absmax moved 4x at step 15 (z 12.2 against 5
    steps), which trend named as the first change. The division, made NaN from finite inputs, is."""
    scope: dict = {}
    exec(compile(GNN, "gnn_loop.py", "exec"), scope)
    with replaydiff.record(tmp_path / "t", tensors="stats", flight=8):
        scope["train"]()
    t = compute_trend(open_trace(tmp_path / "t").rank(0))
    c = t.first_change
    assert c is not None and (c.step, c.statistic, c.op, c.module) == (NAN_STEP, "nan", "aten.div.Tensor", "GNN.c1")
    assert t.cause is not None and t.cause.from_finite and t.cause.index == c.index
    assert t.passed_over is None or (t.passed_over.step < NAN_STEP and not t.passed_over.sound)


def _converging(path, raise_at: int | None = 12) -> None:
    """A small conv net under SGD with momentum on random batches (the loss is the output's mean square: the net
    learns to output zeros, and its last bias's gradient shrinks towards zero); the script raises at ``raise_at``,
    which writes the flight recorder's last 8 steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 8, 3, padding=1), torch.nn.GroupNorm(2, 8), torch.nn.SiLU(),
                                torch.nn.Conv1d(8, 1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with replaydiff.record(path, tensors="stats", flight=8):
        for step in range(1, 21):
            x = torch.randn(4, 2, 32)
            if step == raise_at:
                raise RuntimeError("data loader: shard 7 is corrupt")
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()


def test_a_gradient_shrinking_as_the_run_converges_is_no_change(tmp_path):
    """The last conv's bias gradient falls to 0.028 from a median of 0.13 at step 10 (z = -13.2 against 5 steps),
    3.4x under the lowest value of its window, through steps where it was already falling: no change."""
    with pytest.raises(RuntimeError, match="shard 7"):
        _converging(tmp_path / "t")
    t = compute_trend(open_trace(tmp_path / "t").rank(0))
    assert len(t.steps) >= MIN_HISTORY + 1
    assert t.first_change is None, t.first_change


@pytest.mark.parametrize("cut", [1e-3, 0.0])
def test_a_gradient_cut_by_orders_of_magnitude_or_to_zero_is_a_change(tmp_path, cut):
    """A hook on the model's output scales its gradient by ``cut`` at step 15 (a mistaken loss scale, a detached
    path): every gradient below it falls far under anything in its window, and the hook's mul made it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    with replaydiff.record(tmp_path / "t", tensors="stats", steps="1-20"):
        for step in range(1, 21):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
            out = model(x)
            if step == 15:
                out.register_hook(lambda grad: grad * cut)
            torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad()
    t = compute_trend(open_trace(tmp_path / "t").rank(0))
    c = t.first_change
    assert c is not None and (c.step, c.phase, c.sound) == (15, "backward", True) and c.score < 0
    assert t.cause is not None and (t.cause.op, t.cause.how, t.cause.step) == ("aten.mul.Tensor", "made", 15)
