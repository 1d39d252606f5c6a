"""The flight recorder triggers on what users watch: a loss that goes NaN/Inf while every gradient stays finite (the
value backward() starts from), a parameter made NaN by the update, a model's output that holds NaN/Inf although no
loss is made of it, a value the script reads with .item(); at a normal exit it keeps the last K whole steps. The
trace it writes holds the steps before, and trend names the op that made the non-finite value. NaN/Inf a model makes
and discards inside its forward (T5's log(0) under a where, masked attention scores) trigger nothing."""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import transformers

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


# -- a model's outputs ------------------------------------------------------------------------------------------------
@torch.library.custom_op("flight_test::spike", mutates_args=())
def spike(x: torch.Tensor, bad: bool) -> torch.Tensor:
    """The planted fault: a kernel that returns NaN where ``bad`` (a custom op, below the recorder)."""
    return x * float("nan") if bad else x.clone()


@spike.register_fake
def _(x: torch.Tensor, bad: bool) -> torch.Tensor:
    return torch.empty_like(x)


@dataclasses.dataclass
class NetOutput:  # as a transformers ModelOutput: named fields
    logits: torch.Tensor
    hidden: torch.Tensor


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
        self.bad_at: int | None = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> NetOutput:
        self.calls += 1
        h = spike(torch.tanh(self.a(x)), self.calls == self.bad_at)
        return NetOutput(self.b(h), h)


def _outputs_only(steps: int, bad_at: int | None) -> tuple[list[float], list[torch.Tensor]]:
    """Training whose loss is a weight penalty: the model's outputs are only logged. Returns what was logged and
    the parameters at the end."""
    torch.manual_seed(0)
    net = Net()
    net.bad_at = bad_at
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    logged = []
    for _ in range(steps):
        out = net(torch.randn(5, 4))  # the model's call
        logged.append(out.logits.mean().item())
        sum(p.pow(2).sum() for p in net.parameters()).backward()
        opt.step()
        opt.zero_grad()
    return logged, [p.detach().clone() for p in net.parameters()]


def test_a_nan_output_no_loss_is_made_of_dumps_the_steps_before_and_trend_names_the_planted_op(tmp_path):
    plain = _outputs_only(20, bad_at=12)
    with replaydiff.record(tmp_path / "t", tensors="stats", flight=8):
        watched = _outputs_only(20, bad_at=12)
    torch.testing.assert_close(watched, plain, rtol=0, atol=0, equal_nan=True)  # not a bit changed
    assert math.isnan(watched[0][11]) and all(math.isfinite(v) for v in watched[0][12:])  # the job went on
    r = open_trace(tmp_path / "t").rank(0)
    assert r.complete
    assert sorted({op.step for op in r}) == list(range(5, 13))
    m = re.fullmatch(r"logits of Net\.forward at (\S+):(\d+) holds NaN at step 12", r.flight.reason)
    assert m is not None, r.flight.reason
    line = Path(m[1]).read_text().splitlines()[int(m[2]) - 1]
    assert line.strip().startswith("out = net(") and Path(m[1]).resolve() == Path(__file__).resolve()
    change = compute_trend(r).first_change
    assert change is not None and change.step == 12
    made = r[change.index]
    assert (made.step, made.name, made.module) == (12, "flight_test.spike.default", "Net")


def test_a_nan_value_the_script_only_reads_dumps(tmp_path):
    """A loss made outside any module and only logged (the backward pass runs from another one)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with replaydiff.record(tmp_path / "t", tensors="stats", flight=3):
        for step in range(1, 10):
            out = net(torch.randn(8, 4))
            shift = 100.0 if step == 6 else 0.0
            logged = torch.log(out.abs() + 1 - shift).mean()  # NaN at step 6: log of a negative number
            logged.item()
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    r = open_trace(tmp_path / "t").rank(0)
    assert sorted({op.step for op in r}) == [4, 5, 6]
    read = [op for op in r if op.step == 6 and op.name == "aten._local_scalar_dense.default"]
    assert len(read) == 1
    assert r.flight.reason == f"a value the script read (op #{read[0].index} .item() at {read[0].source}) is " \
                              f"NaN/Inf at step 6"
    change = compute_trend(r).first_change
    assert change is None or change.step == 6


class MaskedScores(torch.nn.Module):
    """Attention scores with the padded keys' set to -inf: an output of a module inside the model, not the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return (q @ k.transpose(-1, -2)).masked_fill(~keep[:, None, :], float("-inf")), v


class MaskedAttention(torch.nn.Module):
    """Softmax over the masked scores (exactly 0 at -inf), and a log(0) a where then drops."""

    def __init__(self) -> None:
        super().__init__()
        self.scores = MaskedScores()

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        scores, v = self.scores(x, keep)
        buckets = torch.log(torch.arange(x.shape[1], dtype=x.dtype))  # -inf at 0
        bias = torch.where(torch.isfinite(buckets), buckets, torch.zeros_like(buckets))
        return (scores.softmax(-1) @ v) + bias[None, :, None]


def _t5() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                                num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    ids = torch.randint(1, 64, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0  # padding: masked attention
    return transformers.T5ForConditionalGeneration(cfg), dict(input_ids=ids, attention_mask=mask,
                                                               labels=torch.randint(1, 64, (2, 5)))


def _masked() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1, 3:] = False
    return MaskedAttention(), dict(x=torch.randn(2, 5, 8), keep=keep)


@pytest.mark.parametrize("make", [_t5, _masked], ids=["t5", "masked-attention"])
def test_non_finite_values_a_model_makes_and_discards_trigger_nothing(tmp_path, make):
    model, batch = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with replaydiff.record(tmp_path / "t", tensors="stats", flight=2, flight_at_exit=True):
        for _ in range(3):
            out = model(**batch)
            (out.loss if hasattr(out, "loss") else out.pow(2).mean()).backward()
            opt.step()
            opt.zero_grad()
    r = open_trace(tmp_path / "t").rank(0)
    assert r.flight.reason == "the process ended (flight_at_exit)"  # no trigger before it
    assert sorted({op.step for op in r}) == [2, 3]
    made = {op.name for op in r if op.phase == "forward" and any(
        ref.stats is not None and ref.stats.inf for ref in op.outputs_refs())}
    assert "aten.log.default" in made  # the model did make -inf (T5: its position buckets)
    if make is _masked:
        assert "aten.masked_fill.Scalar" in made  # and handed it from one of its modules to another


def test_a_failure_of_the_output_watch_costs_the_watch_alone_with_one_warning(tmp_path, monkeypatch):
    from replaydiff.record import output_watch

    def broken(*args, **kwargs):
        raise RuntimeError("cannot look into this output")

    monkeypatch.setattr(output_watch, "floating_outputs", broken)
    plain = _outputs_only(6, bad_at=None)
    with pytest.warns(RuntimeWarning) as said:
        with replaydiff.record(tmp_path / "t", tensors="stats", flight=2, flight_at_exit=True):
            watched = _outputs_only(6, bad_at=None)
    torch.testing.assert_close(watched, plain, rtol=0, atol=0)
    assert [str(w.message) for w in said] == ["replaydiff: the flight recorder stopped watching model outputs for "
                                              "NaN/Inf (RuntimeError: cannot look into this output)"]  # once
    r = open_trace(tmp_path / "t").rank(0)
    assert r.complete and r.flight.reason == "the process ended (flight_at_exit)"
    assert sorted({op.step for op in r}) == [5, 6]


def test_without_statistics_the_outputs_are_counted_by_the_watch_itself(tmp_path):
    """tensors="meta": no statistics to look up; the watch counts the output's NaN/Inf itself, out of the trace."""
    with replaydiff.record(tmp_path / "t", tensors="meta", flight=3):
        _outputs_only(20, bad_at=12)
    r = open_trace(tmp_path / "t").rank(0)
    assert sorted({op.step for op in r}) == [10, 11, 12]
    assert re.fullmatch(r"logits of Net\.forward at \S+:\d+ holds NaN at step 12", r.flight.reason), r.flight.reason
    names = {op.name for op in r}
    assert "flight_test.spike.default" in names and not {"aten.isnan.default", "aten.isinf.default"} & names
