"""From statistics to the cause: the user's path, on a 2-layer MLP.

A weight is multiplied by 100 in the training loop before step 25, outside any module: a one-off ``mul_`` with no
module and no history. ``trend`` of a ``stats`` trace of steps 1-40 must name that ``mul_`` (not the op that reads the
weight), print the zoom-in commands, and the replay of the zoom-in (full tensors, steps 24-25, the module) must say
that no op of it is wrong and through which input of which op the difference enters. Expected op numbers are read
back from the traces, never typed in.
"""
from __future__ import annotations

import json
import shlex

import pytest
import torch

import replaydiff
from replaydiff.cli.main import main as cli_main
from replaydiff.report.entry import describe_entry
from replaydiff.report.trend import describe_cause
from replaydiff.trace import open_trace
from replaydiff.trend import compute_trend
from replaydiff.trend.entry import find_entry
from steps_helpers import one_thread  # noqa: F401 (autouse: one intra-op thread, restored afterwards)

SPIKE_STEP = 25


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def train(model: torch.nn.Module, steps: int = 40, spike_step: int = SPIKE_STEP, before_update: bool = False) -> None:
    """SGD on random regression batches; ``model[2].weight`` times 100 before step ``spike_step``'s forward, in the
    loop and outside any module (what a bad checkpoint reload or a buggy rescaling does), or with ``before_update``
    between its backward and its optimizer step (so that its gradients are those of the weight before)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    for step in range(1, steps + 1):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
        if step == spike_step and not before_update:
            with torch.no_grad():
                model[2].weight.mul_(100)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == spike_step and before_update:
            with torch.no_grad():
                model[2].weight.mul_(100)
        opt.step()
        opt.zero_grad()


@pytest.fixture(scope="module")
def stats_trace(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cause") / "t"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with replaydiff.record(path, tensors="stats", steps="1-40"):
            train(mlp())
    finally:
        torch.set_num_threads(before)
    return str(path)


def test_trend_names_the_one_off_mul_that_wrote_the_weight_not_the_op_that_read_it(stats_trace):
    r = open_trace(stats_trace).rank(0)
    muls = [op for op in r if op.name == "aten.mul_.Tensor"]
    # The trap is set: the mul_ runs once, outside any module, so it has no history of its own to be scored against.
    assert [(op.step, op.module) for op in muls] == [(SPIKE_STEP, None)]
    t = compute_trend(r)
    first = t.first_change
    assert first is not None and first.step == SPIKE_STEP and first.module == "Sequential.2"
    assert r[first.index].name != "aten.mul_.Tensor"  # the first op flagged reads the weight
    c = t.cause
    assert c is not None
    assert (c.index, c.op, c.step, c.module, c.how) == (muls[0].index, "aten.mul_.Tensor", SPIKE_STEP, None, "made")
    assert c.statistic in ("l2", "absmax") and c.value > 50 * c.baseline
    assert c.source is not None and c.source.endswith(f":{muls[0].source.rsplit(':', 1)[1]}")


def test_trend_says_a_change_made_between_recorded_steps_enters_from_outside_the_trace(tmp_path):
    """Steps 1-40:2 leave out step 24, whose update the weight is multiplied before: no op of the trace wrote it, so
    the cause is the op whose input brought the change into step 25, from outside the trace."""
    with replaydiff.record(tmp_path / "t", tensors="stats", steps="1-40:2"):
        train(mlp(), spike_step=SPIKE_STEP - 1, before_update=True)
    r = open_trace(tmp_path / "t").rank(0)
    assert not any(op.name == "aten.mul_.Tensor" for op in r)
    c = compute_trend(r).cause
    assert c is not None and (c.step, c.how, c.producer) == (SPIKE_STEP, "entered", None)
    # The op it names is the first of step 25 to read the spiked weight (3 x 16, as its input 0).
    reader = next(op for op in r if op.step == SPIKE_STEP and op.inputs() and op.inputs()[0].shape == (3, 16))
    assert r.producers(reader.index)[0] is None
    assert (c.index, c.op, c.position, c.module) == (reader.index, reader.name, 0, "Sequential.2")


def test_trend_prints_the_zoom_in_commands_and_the_zoom_in_replay_says_where_the_difference_enters(
        stats_trace, tmp_path, capsys):
    """The cause, the mul_, runs outside any module, where no --module filter reaches: the zoom-in holds it and the
    first change by their op names (--op), and its replay names the mul_ as the op the difference comes from."""
    first = compute_trend(open_trace(stats_trace).rank(0)).first_change
    assert first is not None and first.module == "Sequential.2" and first.op != "aten.mul_.Tensor"
    assert cli_main(["trend", stats_trace]) == 1
    text = capsys.readouterr().out
    zoom = f"{stats_trace}-step{SPIKE_STEP}"
    # recorded from Python: the trace holds no command line to end the record command with (tests/test_trend_next.py)
    record = f"replaydiff record --tensors full --steps 24-25 --op aten.mul_.Tensor --op {first.op} " \
             f"-o {shlex.quote(zoom)} --"
    assert f"\n  {record}\n" in text and f"\n  replaydiff replay {shlex.quote(zoom)}\n" in text
    assert "cause: op #" in text and "aten.mul_.Tensor" in text

    assert cli_main(["trend", stats_trace, "--json", "-"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["cause"]["op"] == "aten.mul_.Tensor" and doc["cause"]["step"] == SPIKE_STEP
    assert doc["next"]["record"] is None and doc["next"]["replay"] == f"replaydiff replay {shlex.quote(zoom)}"
    spec = doc["zoom"]
    assert spec == {"tensors": "full", "steps": "24-25", "modules": None, "ops": ["aten.mul_.Tensor", first.op],
                    "out": zoom}

    # The zoom-in, recorded as the JSON says, holds the mul_ and the first change's op in full, replays clean, and
    # replay says the difference comes from the mul_ (a one-off op: replayed, it computes right).
    out = tmp_path / "zoom"
    with replaydiff.record(out, tensors=spec["tensors"], steps=spec["steps"], ops=spec["ops"]):
        train(mlp())
    z = open_trace(out).rank(0)
    mul = next(op for op in z if op.step == SPIKE_STEP and op.name == "aten.mul_.Tensor")
    reader = next(op for op in z if op.step == SPIKE_STEP and op.name == first.op and op.module == "Sequential.2"
                  and op.phase == "forward")
    assert mul.data_left_out is None and reader.data_left_out is None
    assert cli_main(["replay", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"no replayed op in this trace is wrong ({sum(op.data_left_out is not None for op in z)} skipped): the " \
           f"difference enters through input 2 of op #{reader.index} {first.op} (Sequential.2, forward) at step " \
           f"{SPIKE_STEP}, from op #{mul.index} aten.mul_.Tensor at {mul.source}, which ran in no earlier step of " \
           f"this trace and replays right: the change is its doing" in text, text
    assert cli_main(["replay", str(out), "--json", "-"]) == 0
    enters = json.loads(capsys.readouterr().out)["enters"]
    assert (enters["index"], enters["position"], enters["step"], enters["producer"], enters["producer_source"]) == \
        (reader.index, 2, SPIKE_STEP, mul.index, mul.source)
    assert enters["statistic"] in ("l2", "absmax") and enters["value"] > 50 * enters["previous"]


@pytest.mark.parametrize("tensors", ["stats", "full"])
def test_a_change_written_by_a_filtered_op_enters_from_it(tmp_path, tensors):
    """Recorded with --module Sequential.2, the mul_ (no module) keeps statistics only: trend (stats, steps 1-40)
    follows the edge to it and names it; replay's entry (full, steps 24-25) names the reader's input 0 and the
    filtered op that wrote it."""
    steps = "1-40" if tensors == "stats" else "24-25"
    with replaydiff.record(tmp_path / "t", tensors=tensors, steps=steps, modules="Sequential.2"):
        train(mlp())
    r = open_trace(tmp_path / "t").rank(0)
    mul = next(r[i] for i in range(len(r)) if r[i].name == "aten.mul_.Tensor")
    assert (mul.recorded, mul.step, mul.data_left_out) == (True, SPIKE_STEP, "filtered")
    reader = next(op for op in r if op.step == SPIKE_STEP and op.name == "aten.t.default" and op.phase == "forward"
                  and op.module == "Sequential.2")
    assert r.producers(reader.index)[0] == mul.index  # the filtered op keeps its outputs, so the edge reaches it
    if tensors == "stats":
        c = compute_trend(r).cause  # the filtered mul_ kept its statistics: trend follows the edge to it
        assert (c.index, c.op, c.how, c.step) == (mul.index, "aten.mul_.Tensor", "made", SPIKE_STEP)
        return
    e = find_entry(r)
    assert (e.index, e.position, e.step, e.producer) == (reader.index, 0, SPIKE_STEP, mul.index)
    assert f"input 0 of op #{reader.index} aten.t.default (Sequential.2, forward) at step {SPIKE_STEP}, from op " \
           f"#{mul.index} aten.mul_.Tensor at {mul.source}, which the record filter left out" in describe_entry(e)


def test_clean_replay_of_one_zoomed_step_says_how_to_see_where_the_difference_enters(tmp_path, capsys):
    """Trend's zoom-in, step 25 alone: nothing to compare an input with, and replay says so and what to record."""
    with replaydiff.record(tmp_path / "z", tensors="full", steps=str(SPIKE_STEP), modules="Sequential.2"):
        train(mlp())
    assert find_entry(open_trace(tmp_path / "z").rank(0)) is None
    assert cli_main(["replay", str(tmp_path / "z")]) == 0
    assert capsys.readouterr().out.endswith(
        f"one step ({SPIKE_STEP}) in this trace: record --steps 24-25 to see which input a difference enters through\n")


def test_early_steps_of_plain_adamw_training_show_no_difference_entering(tmp_path):
    """AdamW's moments grow several-fold a step at first, by design (seed 0: the second layer's weight's from
    7.8e-4 to 3.2e-3, step 2 to 3): steps 1-3 of plain training have no difference to name."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with replaydiff.record(tmp_path / "t", tensors="full", steps="1-3"):
        for _ in range(3):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert find_entry(open_trace(tmp_path / "t").rank(0)) is None


NAN_STEP = 8


@pytest.mark.parametrize("how", [{"steps": "1-12"}, {"flight": 4}], ids=["steps", "flight"])
def test_trend_names_the_log_that_made_inf_when_the_code_path_changes(tmp_path, how):
    """From step NAN_STEP on, the loss takes an extra path, ``log`` of a tensor of zeros: -Inf, then NaN everywhere
    downstream. The ops of the new path (and a ``detach`` of another tensor than before) must not be scored against
    the old path's ops; the cause is the ``log``, the first op that made a non-finite value from finite inputs. The
    same in a flight recording, which ends at that step."""
    path = tmp_path / "nan"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    with replaydiff.record(path, tensors="stats", **how):
        for step in range(1, 13):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
            out = model(x)
            loss = torch.nn.functional.mse_loss(out, y)
            if step >= NAN_STEP:
                loss = loss + 0 * torch.log(out - out).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    r = open_trace(path).rank(0)
    logs = [op.index for op in r if op.name == "aten.log.default"]
    t = compute_trend(r)
    assert r[logs[0]].step == NAN_STEP
    assert (t.first_change.step, t.first_change.index, t.first_change.statistic) == (NAN_STEP, logs[0], "inf")
    cause = t.cause_to_tell
    assert cause is not None and (cause.index, cause.op, cause.how) == (logs[0], "aten.log.default", "made")
    assert "made 12 INF value(s) from inputs that had none" in describe_cause(cause)


LR_STEP = 15


def test_trend_says_the_optimizer_update_made_an_lr_spike_and_names_the_argument_that_changed(tmp_path):
    """The learning rate is 1000x at step LR_STEP only: the change is made by the optimizer's ``add_``, whose inputs
    (parameter, gradient) are in line; what differs is its ``alpha`` (minus the learning rate)."""
    path = tmp_path / "lr"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)
    g = torch.Generator().manual_seed(2)
    with replaydiff.record(path, tensors="stats", steps="1-20"):
        for step in range(1, 21):
            for group in opt.param_groups:
                group["lr"] = 10.0 if step == LR_STEP else 0.01
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    t = compute_trend(open_trace(path).rank(0))
    cause = t.cause_to_tell
    assert cause is not None
    assert (cause.step, cause.op, cause.phase, cause.how) == (LR_STEP, "aten.add_.Tensor", "optimizer", "made")
    assert cause.changed_args == ("alpha=-10.0 (-0.01 before)",)
    text = describe_cause(cause)
    assert "the optimizer's update made the change" in text and "alpha=-10.0 (-0.01 before)" in text


BATCH_NAN_STEP = 7


def _batch_nan_trace(path, **how) -> str:
    """The trial's nan.py: ``x[1, 2] = nan`` at step BATCH_NAN_STEP, in the loop and outside any module (lift_fresh
    of a tensor made outside the dispatcher, then copy_ into the batch); the steps after it train on NaN weights.
    A flight recording stops at that step."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    with replaydiff.record(path, tensors="stats", **how):
        for step in range(1, 10):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
            if step == BATCH_NAN_STEP:
                x[1, 2] = float("nan")
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if "flight" in how and step == BATCH_NAN_STEP:
                break
    return str(path)


@pytest.mark.parametrize("how", [{"steps": "1-9"}, {"flight": 4}], ids=["steps", "flight"])
def test_trend_says_a_nan_from_the_batch_enters_through_the_copy_that_wrote_it(tmp_path, how):
    """The first op flagged is the first Linear's addmm, which only carries the batch's NaN; no op made it, so the
    cause is the copy_ through whose input 1 it came in from outside the trace ("entered", not "made"), with a flight
    recording's few steps of history too."""
    r = open_trace(_batch_nan_trace(tmp_path / "nan", **how)).rank(0)
    copy = next(op for op in r if op.name == "aten.copy_.default" and op.step == BATCH_NAN_STEP)
    t = compute_trend(r)
    assert (t.first_change.step, t.first_change.op, t.first_change.module) == \
        (BATCH_NAN_STEP, "aten.addmm.default", "Sequential.0")
    c = t.cause_to_tell
    assert c is not None
    assert (c.index, c.op, c.how, c.position, c.producer, c.statistic, c.value) == \
        (copy.index, "aten.copy_.default", "entered", 1, None, "nan", 1)
    assert f"op #{copy.index} aten.copy_.default (no module, forward) at {copy.source}" in describe_cause(c)
    assert "the change enters through its input 1, 1 NAN value(s) where there were none, from outside the trace" \
        in describe_cause(c)


def test_trend_table_marks_a_tensor_of_nan_instead_of_showing_an_l2_of_zero(tmp_path, capsys):
    """After the NaN batch every gradient is NaN: its statistics of the finite values are l2 0 and absmax 0, which
    the table must not show as a zero gradient. The cell says '-' and the count, the sparkline '!' at such a step;
    the JSON keeps the numbers beside the counts."""
    path = _batch_nan_trace(tmp_path / "nan", steps="1-9")
    t = compute_trend(open_trace(path).rank(0))
    grad = next(s for s in t.series if (s.module, s.kind) == ("Sequential.0", "grad"))
    nan, l2 = grad.values["nan"], grad.values["l2"]
    assert l2[-1] == 0 and nan[-1] > 0 and grad.values["inf"][-1] == 0  # statistics of the finite values: none
    assert cli_main(["trend", path]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line[1:].split()[:2] == ["Sequential.0", "grad"])
    first_nan = next(k for k, v in enumerate(nan) if v)
    assert f"- ({int(nan[-1])} NaN)" in row and row.endswith("!" * (len(nan) - first_nan)), row
    assert " 0 " not in row
    assert cli_main(["trend", path, "--json", "-"]) == 1
    doc = next(s for s in json.loads(capsys.readouterr().out)["series"]
               if (s["module"], s["kind"]) == ("Sequential.0", "grad"))
    assert (doc["l2"][-1], doc["nan"][-1]) == (0.0, nan[-1])
